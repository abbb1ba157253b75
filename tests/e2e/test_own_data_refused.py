"""Your own model and dataset gone wrong, as a user meets them at the command line (one
line naming the object and the fix, exit status 2) and from Python (a typed ConfigError:
a ModelError or a DataError, of one line); either way no worker started (no run
directory)."""

from __future__ import annotations

from pathlib import Path

import pytest

import own_models
import trainwise
import user_job
from helpers import QUIET, hang_limit, run_cli
from trainwise.cli.main import main
from trainwise.errors import DataError, ModelError

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    ("keys", "words"),
    [
        (["data.dataset=user_job:strings"],
         "data.dataset = 'user_job:strings' yields str samples; the step needs tensors"),
        (["data.dataset=user_job:map_data", "data.collate=user_job:no_tensors"],
         "data.collate = 'user_job:no_tensors' makes dict batches with keys ['labels', 'x'] "
         "whose 'labels' is a list"),
        (["data.dataset=user_job:too_short", "data.val_fraction=0.2"],
         "data.dataset = 'user_job:too_short' has 8 samples, fewer than one global batch of "
         "16 (data.micro_batch 8 x data.grad_accum 1 x data-parallel size 2): lower"),
        (["data.dataset=user_job:raises"],
         "data.dataset = 'user_job:raises': calling it raised RuntimeError: the bucket is "
         "not mounted; fix the function"),
    ],
    ids=["wrong-type", "collate-without-tensors", "shorter-than-a-global-batch", "raises"],
)
@pytest.mark.timeout(hang_limit())
def test_bad_data_stops_before_any_worker_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, keys, words
):
    """"raises" as a user types it, in a process of its own (the user's module imported by
    the path its environment gives); the others through trainwise train's main in this
    process: the refusal comes before any worker, a process would prove no more."""
    sets = [a for k in ("model.name=user_job:build", "data.micro_batch=8", *keys)
            for a in ("--set", k)]
    args = ["train", "--nproc", "2", "--strategy", "ddp", "--steps", "2", "--run-dir",
            str(tmp_path / "run"), *QUIET, *sets]
    if "data.dataset=user_job:raises" in keys:
        proc = run_cli(*args, cwd=tmp_path, env=user_job.user_env(tmp_path), timeout=hang_limit())
        rc, err = proc.returncode, proc.stderr
    else:
        for name, value in user_job.user_env(tmp_path).items():
            monkeypatch.setenv(name, value)
        rc, err = main(args), capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainwise: error: "), err
    assert words in lines[0]
    assert not (tmp_path / "run").exists()  # no run files, no event: nothing started


def _broken_factory():  # given as an object no import path names: it goes by value
    def broken():
        raise RuntimeError("the weights file is gone")

    return broken


@pytest.mark.parametrize(
    ("given", "error", "words"),
    [
        ({"model": own_models.raises}, ModelError,
         "model.name = 'own_models:raises': the factory raised RuntimeError: checkpoint file "
         "missing; fix the factory"),
        ({"model": _broken_factory()}, ModelError,
         "model.name = broken (by value): the factory raised RuntimeError: the weights file "
         "is gone"),
        ({"data": user_job.raises}, DataError,
         "data.dataset = 'user_job:raises': calling it raised RuntimeError: the bucket is not "
         "mounted; fix the function"),
        ({"data": user_job.strings}, DataError,  # an instance: by value
         "data.dataset = a Strings (by value) yields str samples; the step needs tensors"),
        ({"collate": user_job.no_tensors}, DataError,
         "data.collate = 'user_job:no_tensors' makes dict batches with keys ['labels', 'x'] "
         "whose 'labels' is a list"),
        ({"data": user_job.too_short}, DataError,
         "data.dataset = 'user_job:too_short' has 8 samples, fewer than one global batch of "
         "16"),
    ],
    ids=["factory-raises", "factory-by-value-raises", "dataset-raises", "wrong-type",
         "collate-without-tensors", "shorter-than-a-global-batch"],
)
@pytest.mark.timeout(hang_limit())
def test_bad_input_from_python_is_a_typed_error_before_any_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given, error, words
):
    monkeypatch.chdir(tmp_path)
    job = {"model": user_job.build, "data": user_job.map_data, **given}
    with pytest.raises(error) as err:
        trainwise.train(
            **job, nproc=2, strategy="ddp", steps=2, run_dir=tmp_path / "run", progress=False,
            oversubscribe=True, overrides={"data.micro_batch": 8, "data.val_fraction": 0.2},
        )
    (line,) = err.value.problems
    assert words in line and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()  # no run files, no event: nothing started
