"""LoRA runs through `trainwise train` on a pretrained Hugging Face Llama (trainwise's GPT
built on the meta device, FSDP2 over frozen and trainable parameters): 2-way FSDP gives
one process's losses; a worker killed mid-run resumes from the adapters' checkpoint and
finishes bit-exact with the uninterrupted run; an FSDP checkpoint resumes on one process;
the checkpoints hold the adapters and their optimizer state, not the frozen base; a resume
onto changed base weights is refused in one line, exit 2, before any worker."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from faulty import fault_limit, finish, job_args, kill, start, wait_for_pid
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from helpers import read_records, run_cli, run_main, tiny_llama

pytest.importorskip("transformers")
# Each test's limit: its runs and the references it may wait for, and for the first, the module fixture's runs.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit(launches=4))]

STEPS = 8  # a checkpoint every 4 (job_args)


def lora_args(run_dir: Path, folder: Path, nproc: int, strategy: str) -> list[str]:
    sets = [
        f"model.name='hf:{folder}'", "model.impl='trainwise'", "data.vocab_size=98",
        "data.seq_len=16", "data.synthetic_tokens=20000", "lora.rank=4", "lora.alpha=8",
    ]
    extra = [a for s in sets for a in ("--set", s)]
    return job_args(run_dir, nproc, strategy, *extra, steps=STEPS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process, 2-way FSDP uninterrupted, and 2-way FSDP killed after step 6 (all on
    `llama`; the one-process run on its own copy)."""
    root = tmp_path_factory.mktemp("lora_resume")
    folder = tiny_llama(root / "llama", vocab=98)
    own = tiny_llama(root / "llama_single", vocab=98)  # the refusal test rewrites it
    out = {"single": root / "single", "fsdp": root / "fsdp", "killed": root / "killed"}
    for name, model, nproc, strategy in (("single", own, 1, "single"), ("fsdp", folder, 2, "fsdp")):
        done = run_cli(*lora_args(out[name], model, nproc, strategy), cwd=root)
        assert done.returncode == 0, done.stderr
    proc = start(lora_args(out["killed"], folder, 2, "fsdp"), root, faults="pause@step=6,rank=1")
    kill(wait_for_pid(proc, out["killed"] / "faults" / "pause-step-6.pid"))
    rc, _, err = finish(proc)
    assert rc == 0, err
    assert "resuming from step 4" in err
    return {**out, "own_model": own}


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_records(run_dir)]


def saved(run_dir: Path, tmp: Path) -> dict:
    """The final checkpoint's DCP state, as one dict."""
    target = tmp / f"{run_dir.name}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step-{STEPS:08d}", target)
    return torch.load(target, weights_only=False)


def test_fsdp_gives_one_process_losses(runs):
    single, fsdp = losses(runs["single"]), losses(runs["fsdp"])
    assert len(single) == len(fsdp) == STEPS
    assert single[-1] != single[0]  # the adapters train
    assert fsdp == pytest.approx(single, rel=1e-5)


def test_killed_run_resumes_bit_exact(runs, tmp_path: Path):
    assert losses(runs["killed"]) == losses(runs["fsdp"])
    whole, resumed = saved(runs["fsdp"], tmp_path), saved(runs["killed"], tmp_path)
    assert whole["model"].keys() == resumed["model"].keys()
    for name, tensor in whole["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name


def test_the_checkpoint_holds_adapters_and_their_optimizer_state(runs, tmp_path: Path):
    state = saved(runs["fsdp"], tmp_path)
    model = state["model"]
    assert model and all(".lora_A." in k or ".lora_B." in k for k in model)
    assert any(float(t.abs().sum()) > 0 for k, t in model.items() if ".lora_B." in k)
    # Moments of the adapters only (DCP's flat optimizer keys: "state.<fqn>.<setting>").
    held = {k[len("state."):].rsplit(".", 1)[0] for k in state["optim"] if k.startswith("state.")}
    assert held == set(model)


def test_resume_onto_changed_base_weights_is_refused_unless_asked(runs, workdir: Path):
    tiny_llama(runs["own_model"], vocab=98, seed=1)  # same names and shapes, other values
    args = lora_args(runs["single"], runs["own_model"], 1, "single")
    args[args.index("--steps") + 1] = str(STEPS + 4)
    done = run_main(*args, cwd=workdir)  # refused before any worker: no process needed
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "lora.base_weights" in ln]
    assert len(lines) == 1 and "other training settings" in lines[0], done.stderr
    # What the line offers: the adapters alone, onto the new base.
    taken = run_cli(*args, "--set", "checkpoint.resume_from_other='weights'", cwd=workdir)
    assert taken.returncode == 0, taken.stderr
    assert "resuming from step 8" in taken.stderr


def test_an_fsdp_checkpoint_resumes_on_one_process(runs, workdir: Path):
    """DCP reshards the adapters and their optimizer state as it does any run's."""
    written = runs["fsdp"] / "checkpoints" / f"step-{4:08d}"
    args = lora_args(workdir / "resharded", runs["fsdp"].parent / "llama", 1, "single")
    done = run_cli(*args, "--set", f"checkpoint.resume={written}", cwd=workdir)
    assert done.returncode == 0, done.stderr
    assert "resuming from step 4" in done.stderr
    assert losses(workdir / "resharded") == pytest.approx(losses(runs["fsdp"])[4:], rel=1e-5)
