"""trainwise as a library: `plan()`, `train()`, `report()`, `doctor()` and `export()`,
each returning a typed record. The CLI's plan, train, report, doctor and export commands
are these functions with their flags parsed: what one does the other does (docs/api.md).
One module a verb (planning, training, reporting, checking, exporting) beside the job they
share (job: JobSpec, the keyword tables, the route of each Python object into a key).

A job is given the way a job file gives it. `config` is a JobConfig, a TOML path, a dict of
sections (`{"optim": {"lr": 3e-4}}`) or a JobSpec; on top of it, section dicts as keywords
(`optim={"lr": 3e-4}`), then the shortcuts of the CLI's flags (`steps=20`, `nproc=2`),
then `overrides` (`{"optim.lr": 3e-4}`): defaults < config < sections < shortcuts <
overrides. `model=` and `data=` take a dict (their section) or a value (model.name,
data.dataset); Python objects (a model factory or nn.Module class, a Dataset or its
factory, a collate or loss function) become job keys through `model_key`, `data_key` and
`function_key`: an import path when one names the object, else the object by value.

Bad input raises a ConfigError (trainwise.errors) naming the key and the fix, before any
worker starts; the CLI turns it into one line and exit status 2. Importing this package
costs nothing of torch, and `plan()` of a preset imports none either.

Floors: between cli/ (which calls it) and report/, run/, doctor/, plan/ (which it calls).
"""


from trainwise.api.checking import DoctorResult, doctor, doctor_job
from trainwise.api.exporting import Exported, export
from trainwise.api.job import (
    JOB_KEYWORDS,
    PLAN_KEYWORDS,
    JobSource,
    JobSpec,
    data_key,
    function_key,
    job_spec,
    model_key,
)
from trainwise.api.planning import plan, plan_job
from trainwise.api.reporting import report, write_report
from trainwise.api.training import RunResult, finish_report, resume_hint, train, train_job

__all__ = [
    "JOB_KEYWORDS",
    "PLAN_KEYWORDS",
    "DoctorResult",
    "Exported",
    "JobSource",
    "JobSpec",
    "RunResult",
    "data_key",
    "doctor",
    "doctor_job",
    "export",
    "finish_report",
    "function_key",
    "job_spec",
    "model_key",
    "plan",
    "plan_job",
    "report",
    "resume_hint",
    "train",
    "train_job",
    "write_report",
]
