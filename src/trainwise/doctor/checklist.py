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


# Checks whose collectives run on the job's backend: not run when the ranks' versions
# differ (a mismatched NCCL or torch is what hangs them).
NEEDS_SAME_VERSIONS = ("bandwidth", "data", "scaling", "smoke")


def run_checks(ctx: Context, names: list[str] | None = None) -> list[CheckResult]:
    """Run the named checks (default: all) in the checklist's order, on every rank. A
    check that raises fails with its error's last line and the others still run; the
    result is the worst over the ranks (rank 0's figures, another rank's failure)."""
    wanted = [n for n in CHECKS if names is None or n in names]
    results: list[CheckResult] = []
    for name in wanted:
        start = time.perf_counter()
        versions = next((r for r in results if r.name == "versions"), None)
        if name in NEEDS_SAME_VERSIONS and versions is not None and versions.status == "fail":
            result = CheckResult.skipped(
                name, name, "not run: the ranks run different versions, and collectives "
                "between them may hang (fix the versions first)",
            )
        else:
            result = _run_one(ctx, name)
        result.seconds = time.perf_counter() - start
        results.append(_worst_over_ranks(ctx, result))
    return results


def _run_one(ctx: Context, name: str) -> CheckResult:
    try:
        return CHECKS[name](ctx)
    except Exception as err:  # noqa: BLE001 - one broken check must not hide the rest
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        return CheckResult(
            name=name, title=name, status="fail",
            measured=f"rank {ctx.env.rank}: {type(err).__name__}: "
            f"{lines[-1] if lines else ''}"[:300],
            detail="the check itself failed", fix="see the traceback in doctor.json",
            data={"traceback": traceback.format_exc()},
        )


def _worst_over_ranks(ctx: Context, result: CheckResult) -> CheckResult:
    """Rank 0's result, unless another rank's check failed where rank 0's did not."""
    everyone = ctx.gather(result if result.status == "fail" else None)
    failed = [r for r in everyone if r is not None]
    if result.status == "fail" or not failed:
        return result
    return failed[0]
