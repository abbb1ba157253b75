"""The files of a run directory written before any worker starts: its default name, the
resolved config, the job's decision and the plan. Light on purpose: the launcher writes
them without importing what the workers need (DCP and DTensor cost seconds to import)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from trainwise.config import JobConfig, dump_toml
from trainwise.errors import ConfigError
from trainwise.run.job.resolve import Job, job_plan
from trainwise.whole_file import write_whole


def default_run_dir(cfg: JobConfig, label: str) -> Path:
    """runs/STAMP-MODEL-LABEL, the label without spaces (`pp 2 x fsdp 2`: pp2-fsdp2)."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    model = cfg.model.name.replace(":", "-").replace("/", "-").replace(".", "-")[-40:]
    label = label.replace(" x ", "-").replace(" ", "")
    return Path("runs") / f"{stamp}-{model}-{label}"


def write_run_files(run_dir: Path, cfg: JobConfig, job: Job) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        plan = job_plan(job)  # the planner's figures, for the report's plan versus actual
        for name, text in (
            ("config.toml", dump_toml(cfg)),
            ("job.json", json.dumps(job.summary_dict(), indent=2) + "\n"),
            *([("plan.json", json.dumps(plan, indent=1) + "\n")] if plan else []),
        ):
            # On several machines each launcher writes the same files into the shared run
            # directory while workers may already read them.
            write_whole(run_dir / name, text)
    except OSError as err:
        raise ConfigError(
            f"logging.run_dir = '{run_dir}' cannot be used ({err.strerror or err}): "
            "choose a writable directory"
        ) from None
