"""What the processes that only check, launch or read import: the launcher resolves a job
(its shape, its tensor-parallel check, a LoRA base's identity, the plan) without DTensor's,
DCP's, FSDP's or dynamo's modules, which only the workers need (about a second of CPU a
launch); `trainwise report` reads and draws a run without torch at all. Each check runs in
a fresh interpreter: this one has imported everything already."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import cli_env, hang_limit

WORKER_ONLY = ("torch.distributed.tensor", "torch.distributed.checkpoint",
               "torch.distributed.fsdp", "torch._dynamo")


def _imported(code: str, watched: tuple[str, ...]) -> list[str]:
    """The modules of `watched` that `code`, run in a fresh interpreter, imported."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {watched!r} if m in sys.modules))\n"
    done = subprocess.run([sys.executable, "-c", probe], env=cli_env(), capture_output=True,
                          text=True, timeout=hang_limit())
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


# A tp job checks its degree against the model's shape; a LoRA job builds its model on the
# meta device for the frozen base's identity (torch's meta normal_ would import dynamo).
@pytest.mark.parametrize(("override", "resolved"), [
    ("parallel.tp=2", "job.dims.tp == 2"),
    ("lora.rank=4", "job.base_weights is not None"),
])
def test_the_launcher_resolves_a_job_without_the_workers_imports(override: str, resolved: str):
    code = (
        "from trainwise.config import load_config\n"
        "from trainwise.hardware import detect_device\n"
        "from trainwise.run.job.resolve import prepare_job\n"
        "import trainwise.run.launch.start, trainwise.run.launch.torchrun\n"
        f"cfg = load_config(overrides=[\"model.name='tiny'\", {override!r}])\n"
        "job = prepare_job(cfg, 2, detect_device('cpu'), 2)\n"
        f"assert {resolved}, job\n"
    )
    assert _imported(code, ("torch", *WORKER_ONLY)) == ["torch"]  # torch: the elastic agent's


def test_the_report_verbs_import_no_torch():
    code = ("import trainwise.cli.report, trainwise.api.reporting, trainwise.report.run_html\n"
            "import trainwise.whole_file, trainwise.doctor.result\n")
    assert _imported(code, ("torch",)) == []
