"""Your own model and dataset, trained as trainwise trains its own: a plain nn.Module
(tests/user_job.py, not trainwise's GPT) on a Hugging Face DatasetDict read from JSONL
files (map-style) and on the same files streamed (an IterableDatasetDict). Real gloo
runs through `trainwise train`:

- every layout (ddp, fsdp, pp 2) gives the losses of one process (fp32, relative 1e-5),
  held-out loss too;
- a worker killed (SIGKILL) mid-run: the run resumes and ends bit-identical to the run left
  alone, the data position included (the stream's own state, restored);
- a run continued on 1 worker after 2 trains on every sample once: the model writes down
  the id of each sample it trains on, and none is missing or repeated.

One module fixture runs each dataset under each layout of LAYOUTS (two launches at a
time); its ddp runs are the uninterrupted references of the kill tests. A new layout is one
more entry of LAYOUTS: pp 2 is one (the user's module, written as docs/parallelism.md
tells, cut into two stages, one a worker).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import user_job
from helpers import (
    QUIET,
    cli_env,
    hang_limit,
    max_rel_diff,
    params_marking_slow,
    read_records,
    run_cli,
    runnable,
    wait_until,
)
from trainwise.data import ShardedBatchSampler

STEPS = 12
FP32_RTOL = 1e-5


@dataclass(frozen=True)
class Layout:
    """How a run of the user's job is laid out; the global batch is 16 in each."""

    nproc: int
    strategy: str  # --strategy
    micro_batch: int
    runs_as: str  # what job.json says it ran (its layout_name)
    sets: tuple[str, ...] = ()  # more --set values


LAYOUTS = {
    "single": Layout(1, "single", 16, "single"),
    "ddp": Layout(2, "ddp", 8, "ddp"),
    "fsdp": Layout(2, "fsdp", 8, "fsdp", ("parallel.shard=full",)),
    # Two stages of the user's module (its embed + block 0, then block 1 + head), one a
    # worker; the layout inside them is set (auto is refused for a user's module in stages).
    "pp": Layout(2, "ddp", 16, "pp 2", ("parallel.pp=2",)),
}
DATASETS = {"hf": "user_job:hf_data", "stream": "user_job:hf_stream"}
# Slow checks (bench/slow_checks.sh), out of make test: the stream under fsdp reads its
# share as under ddp (the sampler does not see the layout); under pp 2 each stage reads it at
# data-parallel size 1, as stream-single does, and hf-pp trains the user's module in stages.
SLOW_RUNS = {("stream", "fsdp"), ("stream", "pp")}
RUNS = runnable([(data, layout) for data in DATASETS for layout in LAYOUTS], SLOW_RUNS)
# The fixture's launches, two at a time, then this module's own: kills, exports, counts.
pytestmark = [
    pytest.mark.dist,
    pytest.mark.timeout(hang_limit(launches=len(RUNS) // 2 + 4, steps=len(RUNS) * STEPS)),
]


def job_args(run_dir: Path, dataset: str, layout: str, *sets: str, steps: int = STEPS) -> list[str]:
    """`trainwise train` of the user's job: checkpoints every 4 steps, held-out loss at the
    end (the fault tests' job shape, so that a kill test's reference is a fixture run)."""
    lay = LAYOUTS[layout]
    keys = [
        "model.name=user_job:build", f"data.dataset={dataset}",
        f"data.micro_batch={lay.micro_batch}", "data.global_batch=16",
        f"train.eval_every={steps}", "checkpoint.interval=4", "checkpoint.keep_last=3",
        f"parallel.timeout_s={hang_limit():g}", "logging.probe_every=0", *lay.sets, *sets,
    ]
    return [
        "train", "--nproc", str(lay.nproc), "--strategy", lay.strategy, "--steps", str(steps),
        "--run-dir", str(run_dir), *QUIET, *[a for k in keys for a in ("--set", k)],
    ]


def train(root: Path, data_dir: Path, args: list[str]) -> subprocess.CompletedProcess:
    done = run_cli(*args, cwd=root, env=user_job.user_env(data_dir),
                   timeout=hang_limit(steps=STEPS))
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The JSONL files, and the Hugging Face cache of them made once here (the fixture's
    launches then read it rather than each building it)."""
    folder = user_job.write_jsonl(tmp_path_factory.mktemp("user-data"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(user_job.DIR_ENV, str(folder))
        user_job.hf_data()
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[tuple, Path]:
    """Each dataset under each layout: (dataset, layout) -> its run directory."""
    root = tmp_path_factory.mktemp("own-data")

    def one(data: str, layout: str) -> Path:
        run_dir = root / f"{data}-{layout}"
        done = train(root, data_dir, job_args(run_dir, DATASETS[data], layout))
        (run_dir / "stderr.txt").write_text(done.stderr)
        return run_dir

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(one, *key) for key in RUNS}
        return {key: future.result() for key, future in futures.items()}


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_records(run_dir)]


def eval_loss(run_dir: Path) -> float:
    return read_records(run_dir)[-1]["eval_loss"]


# --- the layouts ---------------------------------------------------------------------------


@pytest.mark.parametrize(("data", "layout"), params_marking_slow(
    [(data, layout) for data in DATASETS for layout in LAYOUTS if layout != "single"], SLOW_RUNS
))
def test_a_layout_trains_as_one_process(runs, data: str, layout: str):
    job = json.loads((runs[data, layout] / "job.json").read_text())
    assert (job["world"], job["layout_name"]) == (LAYOUTS[layout].nproc, LAYOUTS[layout].runs_as)
    one = runs[data, "single"]
    assert max_rel_diff(losses(runs[data, layout]), losses(one), STEPS) <= FP32_RTOL
    assert eval_loss(runs[data, layout]) == pytest.approx(eval_loss(one), rel=FP32_RTOL)


@pytest.mark.parametrize("data", list(DATASETS))
def test_the_users_model_learns(runs, data: str):
    steps = losses(runs[data, "single"])
    assert steps[-1] < steps[0] - 0.2
    assert eval_loss(runs[data, "single"]) < steps[0]  # on the validation split


def test_the_stream_says_before_training_how_it_is_read_and_resumed(runs):
    said = (runs["stream", "ddp"] / "stderr.txt").read_text()
    assert "every rank reads the whole stream and keeps its share of each global batch" in said
    assert "restores its position from its state_dict" in said


# --- kill -9 mid-run ------------------------------------------------------------------------


def trained_state(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The model and optimizer tensors of a run's checkpoint, read whole by DCP's own
    converter (in this process: no export launch)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir / f"state-{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step-{step:08d}", out)
    state = torch.load(out, weights_only=False)
    return {f"{part}.{k}": v for part in ("model", "optim") for k, v in state[part].items()}


def wait_for(proc: subprocess.Popen, marker: Path, limit: float) -> int:
    """The pid a paused worker wrote; fails at once if the run ended before pausing."""
    wait_until(marker.exists, limit=limit, what=marker.name, procs=[proc])
    return int(marker.read_text())


def data_position(run_dir: Path, step: int) -> dict:
    trainer = run_dir / "checkpoints" / f"step-{step:08d}" / "trainer.json"
    return json.loads(trainer.read_text())["data"]


# Slow checks (bench/slow_checks.sh), out of make test: map-style data's kill and its
# 2 -> 1 continuation. Its position is the step, through the sampler every map-style
# dataset shares (ShardedBatchSampler): test_kill resumes the built-in data bit for bit,
# test_reshard's fsdp 2 -> single continues it on one rank, and the sampler's unit tests
# (test_data) check the resumed and re-split index streams. The stream keeps its own state:
# both of its cases stay.
@pytest.mark.parametrize("data", params_marking_slow(DATASETS, {"hf"}))
def test_a_kill_mid_run_resumes_bit_identical_data_position_included(
    runs, data_dir: Path, tmp_path: Path, data: str
):
    broken = tmp_path / "broken"
    env = {**cli_env(), **user_job.user_env(data_dir), "TRAINWISE_FAULTS": "pause@step=10,rank=1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwise", *job_args(broken, DATASETS[data], "ddp")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    pid = wait_for(proc, broken / "faults" / "pause-step-10.pid", hang_limit(steps=10))
    os.kill(pid, signal.SIGKILL)  # after step 10; the last checkpoint is step 8
    _, err = proc.communicate(timeout=hang_limit(launches=2, steps=STEPS))
    assert proc.returncode == 0, err[-3000:]

    events = [json.loads(x) for x in (broken / "events.jsonl").read_text().splitlines()]
    failure = next(e for e in events if e["kind"] == "failure")
    assert failure["pid"] == pid and failure["signal"] == "SIGKILL"
    assert next(e for e in events if e["kind"] == "resume")["step"] == 8
    if data == "stream":  # its position came back from the dataset's own state
        assert "data: the stream restored at sample 128 from the dataset's state_dict" in err
    reference = runs[data, "ddp"]
    assert data_position(broken, 12) == data_position(reference, 12)
    assert data_position(broken, 12)["samples"] == 12 * 16
    ours, theirs = trained_state(broken, STEPS), trained_state(reference, STEPS)
    assert ours.keys() == theirs.keys() and len(ours) > 10
    for name, value in ours.items():
        other = theirs[name]
        assert torch.equal(value, other) if torch.is_tensor(value) else value == other, name
    assert losses(broken)[-1] == losses(reference)[-1]


# --- 2 workers, then 1: every sample once ------------------------------------------------------


def expected_map_ids(steps: int) -> list[int]:
    """The sampler's stream of the held-out map-style data (its training split's ids)."""
    n = user_job.SAMPLES - round(user_job.SAMPLES * 0.05)  # data.val_fraction's default
    sampler = ShardedBatchSampler(n, 16, 1, 0, 1, seed=0)
    return [i for s in range(steps) for i in sampler.indices(s, 0)]


@pytest.mark.parametrize("dataset", params_marking_slow(
    ["user_job:map_counted", "user_job:hf_stream_counted"], {"user_job:map_counted"}))
def test_one_worker_after_two_trains_on_every_sample_once(tmp_path: Path, dataset: str):
    folder = user_job.write_jsonl(tmp_path / "data")
    run_dir = tmp_path / "run"
    quiet = ("train.eval_every=0",)
    train(tmp_path, folder, job_args(run_dir, dataset, "ddp", *quiet, steps=6))
    done = train(tmp_path, folder, job_args(run_dir, dataset, "single", *quiet))
    assert "resuming from step 6" in done.stderr

    seen = user_job.seen_ids(folder)
    assert len(seen) == len(set(seen)) == STEPS * 16  # none twice
    if dataset.endswith("stream_counted"):
        assert sorted(seen) == list(range(STEPS * 16))  # the stream's first 192, none skipped
        assert "data: the stream restored at sample 96" in done.stderr
    else:
        assert sorted(seen) == sorted(expected_map_ids(STEPS))
