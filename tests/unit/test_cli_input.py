"""Bad command lines get one line and exit status 2 before anything starts: argparse's
own errors (no usage block), CPU workers beyond the cores, a Slurm job name that could
not name a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainwise.cli.main import main
from trainwise.config import load_config
from trainwise.errors import ConfigError
from trainwise.hardware import DeviceInfo
from trainwise.run.job.resolve import check_cores

REPO = Path(__file__).resolve().parents[2]
CPU = DeviceInfo(kind="cpu", name="cpu", count=1, memory_bytes=0.0, bf16=False, fp16=False,
                 gpu=None)


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["train", "--nproc", "x"], "trainwise train"),
        (["train", "--no-such-flag"], "trainwise train"),
        (["launch", "slurm", "--config", "job.toml"], "trainwise launch slurm"),
        (["no-such-command"], "trainwise"),
    ],
)
def test_argparse_errors_are_one_line_naming_help(argv, prog, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"{prog}: error: ") and f"`{prog} --help`" in lines[0]
    assert "usage:" not in captured.err and captured.out == ""


def test_cpu_workers_beyond_the_cores_are_refused_unless_asked():
    asked = load_config(overrides=["cluster.nproc=8"])
    with pytest.raises(ConfigError) as refused:
        check_cores(asked, CPU, nproc=8, cores=2)
    (line,) = refused.value.problems
    assert "--nproc 8" in line and "2 cores" in line and "--oversubscribe" in line
    check_cores(asked, CPU, nproc=2, cores=2)  # as many as the cores
    allowed = load_config(overrides=["cluster.nproc=8", "cluster.oversubscribe=true"])
    check_cores(allowed, CPU, nproc=8, cores=2)
    # The default (2 CPU workers) was not asked for: a 1-core machine keeps the warning.
    check_cores(load_config(), CPU, nproc=2, cores=1)


def test_oversubscribe_flag_sets_the_key(capsys):
    assert main(["train", "--nproc", "8", "--oversubscribe", "--print-config"]) == 0
    assert "oversubscribe = true" in capsys.readouterr().out


def test_train_refuses_before_any_worker(tmp_path, capsys):
    """In-process: the refusal comes before the run directory or any worker exists."""
    run_dir = tmp_path / "run"
    rc = main(["train", "--nproc", "4096", "--set", "cluster.device='cpu'",
               "--run-dir", str(run_dir)])
    assert rc == 2 and not run_dir.exists()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("trainwise: error: --nproc 4096")


@pytest.mark.parametrize("name", ["a" * 300, "bad name", "x/../y"])
def test_a_slurm_name_that_cannot_name_a_file_is_one_line(name, tmp_path, capsys):
    rc = main(["launch", "slurm", "--config", str(REPO / "tests/golden/job.toml"), "--nodes",
               "2", "--gpus-per-node", "8", "--name", name, "--print"])
    assert rc == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("trainwise: error: --name ") and "at most 240" in line
    assert len(line) < 300 and captured.out == ""
