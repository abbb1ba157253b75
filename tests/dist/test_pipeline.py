"""Pipeline parallelism trains the same model as one process: two torchrun launches of
pp_worker.py (2 gloo workers: every schedule offered, for the built-in GPT preset `small`
and an HF Llama config read into trainwise's GPT, with gradient accumulation in three
cases, one on packed SFT data with ignored prompt targets; 4 workers: pp 2 x dp_shard 2,
pp 2 x 2 replicas and pp 2 x tp 2), each case's losses, gradient norms and held-out loss
compared with one process (trained here, without a process group), and a step with a NaN
loss skipped on every stage; apart, a launch whose examples are cut inside their prompt.

fp32, 1e-5: measured on a 2-core CPU, the largest relative difference over every case was
4.3e-7 (pp 2 x dp_shard 2's gradient norm; the sums run in another order across stages and
shards); the held-out losses were equal."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import (
    CUT_PROMPT_JOB,
    QUIET,
    cut_prompt_corpus,
    hang_limit,
    max_rel_diff,
    read_records,
    run_cli,
    run_limited,
    sft_corpus,
    worker_failure,
)

WORKER = Path(__file__).with_name("pp_worker.py")
_spec = importlib.util.spec_from_file_location("pp_worker", WORKER)
pp_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pp_worker)
RTOL = 1e-5


def _launch_limit(world: int) -> float:
    """A launch's hang limit: it builds and trains each case, about a launch's work each."""
    cases = len(pp_worker.CASES if world == 2 else pp_worker.CASES_4)
    return hang_limit(launches=cases, procs=world, steps=cases * pp_worker.STEPS)


# The first test of each fixture carries its launch; the references train in this process
# (a case each, about a launch's work).
pytestmark = [pytest.mark.dist, pytest.mark.timeout(
    _launch_limit(2) + _launch_limit(4) + hang_limit(launches=len(pp_worker.CASES) + len(pp_worker.CASES_4)))]


def launch(root: Path, world: int) -> list[dict]:
    proc = run_limited(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
         "--standalone", str(WORKER), str(root), str(world)],
        what=f"pp_worker.py on {world} workers", limit=_launch_limit(world),
    )
    assert proc.returncode == 0, worker_failure(proc.stderr)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("pipeline")
    config = {k: v for k, v in pp_worker.LLAMA.items() if k != "model_type"}
    transformers.LlamaConfig(**config).save_pretrained(folder / "llama")  # config.json only
    sft_corpus(folder)  # folder / "sft": packed prompt / response examples
    return folder


@pytest.fixture(scope="module")
def two(root: Path) -> list[dict]:
    return launch(root, 2)


@pytest.fixture(scope="module")
def four(root: Path) -> list[dict]:
    return launch(root, 4)


_references: dict[tuple, dict] = {}


def reference(root: Path, case: tuple) -> dict:
    """One process's run of `case`: the same samples a step (the pipeline's data-parallel
    ranks' micro-batches in one)."""
    model, world, _, _, mb, accum, extra = case
    dp = world // 2 // (2 if "parallel.tp=2" in extra else 1)  # pp 2
    data = [e for e in extra if e.startswith(pp_worker.BOTH)]  # data.*, lora.*
    key = (model, mb * dp, accum, *data)
    if key not in _references:
        single = (model, 1, None, 1, mb * dp, accum, data)
        _references[key] = pp_worker.case_losses(single, root, pipeline=False)
    return _references[key]


def assert_matches(got: dict, want: dict) -> None:
    steps = pp_worker.STEPS
    assert max_rel_diff(got["losses"], want["losses"], steps) <= RTOL
    # The norm clipping and the guard read: completed over the stages (a tied head once).
    assert max_rel_diff(got["grad_norms"], want["grad_norms"], steps) <= RTOL
    assert abs(got["eval"] / want["eval"] - 1) <= RTOL


@pytest.mark.parametrize("name", list(pp_worker.CASES))
def test_two_stages_train_one_processs_losses(two, root, name):
    ranks = [r[name] for r in two]
    assert_matches(ranks[0], reference(root, pp_worker.CASES[name]))
    # The last stage's loss reached the first stage's rank (the one that records).
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["layout"] == "pp 2 x dp_replicate 1 x dp_shard 1 x tp 1"
    virtual = pp_worker.CASES[name][3]
    assert [r["parts"] for r in ranks] == [virtual, virtual]
    # A NaN loss on the last stage: every stage saw the non-finite norm and skipped the
    # update, its shards and optimizer state untouched (the held-out loss above is still
    # one process's, which skipped it too).
    assert [r["guard"] for r in ranks] == [[False, True, True]] * 2


def test_the_step_is_split_into_compute_bubble_and_communication(two):
    for name in pp_worker.CASES:
        spans, sync = two[0][name]["spans"], two[0][name]["sync"]
        assert spans["compute"] > 0 and spans["bubble"] >= 0 and sync is not None, name
    # The first stage of a 2-stage GPipe waits for the other's whole forward and backward.
    assert two[0]["small-gpipe"]["spans"]["bubble"] > 0


def test_pipeline_times_fsdp_trains_one_processs_losses(four, root):
    name = "small-1f1b-fsdp2"
    ranks = [r[name] for r in four]
    assert ranks[0]["layout"] == "pp 2 x dp_replicate 1 x dp_shard 2 x tp 1"
    # Ranks of different stages read the same samples: the data-parallel rank skips pp.
    assert [r["dp_rank"] for r in ranks] == [0, 1, 0, 1]
    # parallel.shard is 'full' (the default), yet under 1F1B every block of every stage
    # stays gathered from its forward to the step's last backward, as the plan prices it
    # (ParallelDims' rule under pp, torchtitan's default): no gather per micro-batch.
    assert all(r["kept_gathered"] and all(r["kept_gathered"]) for r in ranks)
    assert_matches(ranks[0], reference(root, pp_worker.CASES_4[name]))


def test_pipeline_times_replicas_trains_one_processs_losses(four, root):
    name = "small-gpipe-ddp2"
    ranks = [r[name] for r in four]
    assert ranks[0]["layout"] == "pp 2 x dp_replicate 2 x dp_shard 1 x tp 1"
    assert [r["dp_rank"] for r in ranks] == [0, 1, 0, 1]
    assert_matches(ranks[0], reference(root, pp_worker.CASES_4[name]))


def test_pipeline_times_tensor_parallel_trains_one_processs_losses(four, root):
    name = "llama-interleaved1f1b-tp2"
    ranks = [r[name] for r in four]
    assert ranks[0]["layout"] == "pp 2 x dp_replicate 1 x dp_shard 1 x tp 2"
    assert [r["dp_rank"] for r in ranks] == [0, 0, 0, 0]
    assert_matches(ranks[0], reference(root, pp_worker.CASES_4[name]))


def test_examples_cut_inside_their_prompt_are_no_failed_step(tmp_path: Path):
    """Two stages, one example a step, every third cut inside its prompt (no counted
    target): such a step weighs 0 instead of 0 / 0 (a NaN gradient the guard skipped as a
    failure), records 0, and the held-out mean leaves such batches out."""
    proc = run_cli(
        "train", *QUIET, *CUT_PROMPT_JOB, "--set", f"data.path={cut_prompt_corpus(tmp_path)}",
        "--nproc", "2", "--set", "parallel.strategy=ddp", "--set", "parallel.pp=2", "--set",
        "parallel.pp_schedule=GPipe", "--set", "train.steps=6", "--set", "train.eval_every=6",
        "--set", "logging.run_dir=run", cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "non-finite" not in proc.stderr
    steps = read_records(tmp_path / "run")
    assert len(steps) == 6 and all(np.isfinite([r["loss"], r["grad_norm"]]).all() for r in steps)
    assert any(r["grad_norm"] == 0.0 and r["loss"] == 0.0 for r in steps)
    assert np.isfinite(steps[-1]["eval_loss"]) and steps[-1]["eval_loss"] > 0
