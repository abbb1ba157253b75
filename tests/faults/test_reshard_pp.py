"""Checkpoints under pipeline stages, on four shared launches of a tiny Hugging Face Llama
(4 layers, model.impl = 'trainwise', its pretrained weights written to a tmp dir), a chain
that visits each layout and crosses pp both ways (pp -> fsdp -> fsdp x tp -> pp):

1. pp 2 (1F1B, a stage per rank) from the pretrained weights, 12 steps, a checkpoint every
   4; the last stage's worker is killed at step 11 and the run restarts from its own
   step-8 checkpoint;
2. plain FSDP (dp_shard 2, 2 processes) resumes the pp run's step-4 checkpoint, saving
   every 2 steps;
3. dp_shard 2 x tp 2 (4 processes) resumes the FSDP run's step-6 checkpoint;
4. pp 2 with two stages per rank (Interleaved1F1B: each rank's states span two model
   parts) resumes that run's step-8 checkpoint.

Each continues the losses of the pp run; the restart after the kill repeats them exactly;
the killed worker held one gloo group, the job's;
the first step's loss is transformers' on the first batch (each stage loaded its own
tensors); `export --format hf` of the pp run gives the trained model's logits. The
unit tests of the states over several parts are tests/unit/test_checkpoint_parts.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from faulty import fault_limit, finish, job_args, kill, start, thread_names, wait_for_pid

from helpers import read_records, run_cli, run_main, tiny_llama

# Each test's limit: its runs and the references it may wait for, and for the first, the module fixture's runs.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit(launches=5))]
transformers = pytest.importorskip("transformers")

VOCAB = 256  # the synthetic data's: the pretrained vocabulary must hold its ids
SEQ = 32
LAYERS = 4  # pp 2 x pp_virtual 2 stages of one layer each
# name -> (nproc, strategy, extra); the global batch stays 16 (job_args' contract).
LAYOUTS = {
    "pp2": (2, "ddp", ("--set", "parallel.pp=2", "--set", "data.micro_batch=16")),
    "fsdp2": (2, "fsdp", ()),
    "fsdp2_tp2": (4, "fsdp", ("--set", "parallel.tp=2", "--set", "data.micro_batch=8")),
    "pp2_interleaved": (2, "ddp", ("--set", "parallel.pp=2", "--set", "data.micro_batch=16",
                                   "--set", "parallel.pp_schedule=Interleaved1F1B",
                                   "--set", "parallel.pp_virtual=2")),
}


def _args(root: Path, name: str, layout: str, *extra: str) -> list[str]:
    nproc, strategy, more = LAYOUTS[layout]
    model = ("--set", f"model.name='hf:{root / 'llama'}'", "--set", "model.impl=trainwise",
             "--set", f"data.seq_len={SEQ}")
    return job_args(root / name, nproc, strategy, *model, *more, *extra)


def _resume(root: Path, name: str, layout: str, written: Path, step: int, *extra: str) -> Path:
    checkpoint = written / "checkpoints" / f"step-{step:08d}"
    done = run_cli(*_args(root, name, layout, "--set", f"checkpoint.resume={checkpoint}", *extra),
                   cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from step {step}" in done.stderr
    return root / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("reshard_pp")
    tiny_llama(root / "llama", vocab=VOCAB, layers=LAYERS)
    pp = root / "pp"
    proc = start(_args(root, "pp", "pp2"), root, faults="pause@step=11,rank=1")
    pid = wait_for_pid(proc, pp / "faults" / "pause-step-11.pid")
    threads = thread_names(pid)  # of the last stage's worker, paused after step 11
    kill(pid)
    rc, _, err = finish(proc)
    assert rc == 0, err[-3000:]
    assert "resuming from step 8" in err
    # Every 2 steps, all kept: the next leg resumes its step 6 while the run goes on to 12.
    fsdp = _resume(root, "fsdp", "fsdp2", pp, 4,
                   "--set", "checkpoint.interval=2", "--set", "checkpoint.keep_last=4")
    tp = _resume(root, "tp", "fsdp2_tp2", fsdp, 6)
    back = _resume(root, "pp-again", "pp2_interleaved", tp, 8)
    return {"root": root, "pp": pp, "fsdp": fsdp, "tp": tp, "pp_again": back,
            "threads": threads}


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run_dir) if "loss" in r}


def test_a_worker_killed_under_pp_resumes_bit_exact(runs):
    """The steps after the step-8 checkpoint ran before the kill and again after the
    restart (metrics.jsonl keeps both records): the same loss and gradient norm to the bit
    (the weights, optimizer, data position and RNG came back)."""
    records: dict[int, list[dict]] = {}
    for r in read_records(runs["pp"]):
        if "loss" in r:
            records.setdefault(r["step"], []).append(r)
    assert sorted(records) == list(range(1, 13))
    repeated = {s: rs for s, rs in records.items() if len(rs) > 1}
    assert repeated and min(repeated) == 9, sorted(repeated)  # the restart began at step 9
    for step, (first, again) in repeated.items():
        assert (first["loss"], first.get("grad_norm")) == (again["loss"], again.get("grad_norm")), step


def test_a_pipeline_worker_holds_one_gloo_group(runs):
    """The stages' sends, the tied head's gradients and the norm run on the job's own
    group (pp 2 over 2 ranks): no other group, each of which would keep an event loop
    waking every 10 ms beside the step (one thread of that name a group)."""
    assert runs["threads"].count("gloo_tcp_loop") == 1, runs["threads"]


def test_resumes_across_layouts_continue_the_pp_runs_losses(runs):
    """pp 2 -> fsdp 2 -> dp_shard 2 x tp 2 -> pp 2: each resumed run's losses are the pp
    run's. Not to the bit: neighbouring layouts sum in other orders (pp sums the gradients
    of 16 one-sample micro-batches, FSDP reduce-scatters two halves of 8 samples, TP also
    splits the matmuls), so fp32 rounding (rel 1e-5). Measured on CPU: the FSDP leg within
    2e-7, the TP leg equal but for one step; the last leg (pp's arithmetic again) equal on
    every step, but its weights came through FSDP and TP, so that is not asserted."""
    pp = _losses(runs["pp"])
    for name, start_at in (("fsdp", 4), ("tp", 6), ("pp_again", 8)):
        got = _losses(runs[name])
        assert sorted(got) == list(range(start_at + 1, 13)), name
        for step, loss in got.items():
            assert loss == pytest.approx(pp[step], rel=1e-5, abs=1e-6), (name, step)


def test_the_pp_run_starts_from_transformers_logits(runs):
    """Step 1's loss under pp 2 (before any update) is the cross-entropy of the logits
    transformers gives on the first batch: every stage loaded its pretrained tensors."""
    from trainwise.config import load_config
    from trainwise.data import build_loader
    from trainwise.run.job.resolve import data_and_model

    root, pp = runs["root"], runs["pp"]
    cfg = load_config(pp / "config.toml")
    train = data_and_model(cfg, []).datasets[0]
    x, y = next(iter(build_loader(train, micro_batch=16, grad_accum=1, dp_rank=0, dp_size=1,
                                  seed=cfg.train.seed, num_steps=1)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "llama").eval()
    with torch.no_grad():
        logits = hf(input_ids=x).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).item()
    first = _losses(pp)[1]
    assert math.isclose(first, want, rel_tol=1e-5), (first, want)


def test_export_hf_of_the_pp_run_gives_the_trained_logits(runs):
    """The pp run's last checkpoint (each stage wrote its own tensors under the whole
    model's names) exports as one Hugging Face model with the trained model's logits."""
    from trainwise.export.weights import load_model_state, resolve_checkpoint
    from trainwise.models import ModelSpec, build_model

    root, pp = runs["root"], runs["pp"]
    done = run_main("export", str(pp), "--format", "hf", "-o", str(root / "pp-hf"), cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((root / "pp-hf" / "config.json").read_text())["num_hidden_layers"] == LAYERS
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / "pp-hf").eval()
    spec = ModelSpec(name=f"hf:{root / 'llama'}", seq_len=SEQ, impl="trainwise", init="random")
    trained = build_model(spec).module.eval()
    trained.load_state_dict(load_model_state(resolve_checkpoint(pp)), strict=True)
    idx = torch.load(root / "llama" / "idx.pt")
    with torch.no_grad():
        got, want = exported(input_ids=idx).logits, trained(idx)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    original = torch.load(root / "llama" / "logits.pt")
    assert not torch.allclose(got, original, atol=1e-3)  # training moved the weights
