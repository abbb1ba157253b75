"""The checklist: every check by name, in order, and the run of them on every rank."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

from trainwise.config.schema import CHECK_NAMES
from trainwise.doctor.checks import check_bandwidth, check_disk, check_memory, check_versions
from trainwise.doctor.context import Context
from trainwise.doctor.data_check import check_data
from trainwise.doctor.result import CheckResult
from trainwise.doctor.scaling import check_scaling
from trainwise.doctor.smoke import check_smoke

CHECKS: dict[str, Callable[[Context], CheckResult]] = {
    "versions": check_versions,
    "bandwidth": check_bandwidth,
    "data": check_data,
    "scaling": check_scaling,
    "smoke": check_smoke,  # before memory: its steps are what the memory check reads
    "memory": check_memory,
    "disk": check_disk,
}
assert tuple(CHECKS) == CHECK_NAMES, "the config's names and the checklist must agree"


def run_checks(ctx: Context, names: list[str] | None = None) -> list[CheckResult]:
    """Run the named checks (default: all) in the checklist's order. A check that raises
    fails with its error's last line; the others still run."""
    wanted = [n for n in CHECKS if names is None or n in names]
    results = []
    for name in wanted:
        start = time.perf_counter()
        try:
            result = CHECKS[name](ctx)
        except Exception as err:  # noqa: BLE001 - one broken check must not hide the rest
            lines = [line for line in str(err).strip().splitlines() if line.strip()]
            result = CheckResult(
                name=name, title=name, status="fail",
                measured=f"{type(err).__name__}: {lines[-1] if lines else ''}"[:300],
                detail="the check itself failed", fix="see the traceback in doctor.json",
                data={"traceback": traceback.format_exc()},
            )  # fmt: skip
        result.seconds = time.perf_counter() - start
        results.append(result)
    return results
