"""trainwise: plan, train, check and report distributed PyTorch training.

As a library (docs/api.md): `trainwise.plan(...)`, `trainwise.train(...)`,
`trainwise.report(run_dir)`, `trainwise.doctor(...)` and `trainwise.export(run_dir, out)`,
each returning a typed record.
Importing trainwise imports no torch; the records of the report and the doctor are
imported when first named.

`plan`, `report` and `doctor` are also the names of subpackages (trainwise/plan/, ...):
here they stay the functions even after a subpackage is imported (the package keeps them,
below); reach a subpackage's modules by `from trainwise.plan.planner import make_plan`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from trainwise.api import (
    DoctorResult,
    Exported,
    JobSpec,
    RunResult,
    doctor,
    export,
    plan,
    report,
    train,
    write_report,
)
from trainwise.records import JobRecord, Plan, RunPlan, RunSummary, StepRecord, StopEvent
from trainwise.third_party import quiet_torchao

quiet_torchao()

__version__ = "0.1.0"

__all__ = [
    "DoctorRecord",
    "DoctorResult",
    "Exported",
    "JobRecord",
    "JobSpec",
    "Plan",
    "RunPlan",
    "RunReport",
    "RunResult",
    "RunSummary",
    "StepRecord",
    "StopEvent",
    "__version__",
    "doctor",
    "export",
    "plan",
    "report",
    "train",
    "write_report",
]
VERBS = ("plan", "report", "doctor", "export")  # the functions that share a subpackage's name
_LAZY = {  # record types whose modules import more than a record should cost
    "RunReport": "trainwise.report.analysis",
    "DoctorRecord": "trainwise.doctor.result",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainwise' has no attribute {name!r}")


class _Package(types.ModuleType):
    """The trainwise package, which keeps its verbs: importing `trainwise.plan.x` binds the
    subpackage `plan` as an attribute of its parent; that binding is dropped here, so
    `trainwise.plan` stays the function (the subpackage stays in sys.modules)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in VERBS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
