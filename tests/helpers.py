"""Shared test helpers: run the CLI as a user types it, in a separate process (under the
hang limits of limits.py, re-exported here), and the small models and corpora of the tests."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Container, Iterable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from limits import (  # noqa: F401 (re-exported: the tests import them from here)
    Hung,
    cli_env,
    communicate,
    hang_limit,
    locked,
    machine_speed,
    run_limited,
    shared_dir,
    wait_until,
    worker_failure,
)

T = TypeVar("T")
SLOW_CHECKS_ENV = "TRAINWISE_SLOW_CHECKS"  # set by bench/slow_checks.sh


def slow_checks() -> bool:
    """Whether this session runs the checks moved out of `make test` (marker slow_check):
    their modules' shared launches then train the runs those checks compare too."""
    return os.environ.get(SLOW_CHECKS_ENV) == "1"


def runnable(values: Iterable[T], slow: Container[T]) -> list[T]:
    """`values` that this session runs: those in `slow` only under slow_checks()."""
    return [v for v in values if v not in slow or slow_checks()]


def params_marking_slow(values: Iterable[Any], slow: Container[Any]) -> list:
    """pytest params of `values` (a tuple: one argument each), those in `slow` marked
    slow_check."""
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)),
                         marks=[pytest.mark.slow_check] if v in slow else [])
            for v in values]


# Quiet, fast, loopback-only runs: every test job sets these.
# The tests run up to 4 CPU workers on 2 cores on purpose (layouts, not speed).
ON_FEW_CORES = ["--set", "cluster.oversubscribe=true"]
QUIET = ["--set", "logging.progress=none", "--set", "logging.tensorboard=false",
         "--set", "logging.report=false", *ON_FEW_CORES]


def run_cli(
    *args: str, cwd: Path, timeout: float | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`trainwise ARGS` in `cwd`; `env` adds variables (a test's fault, say). `timeout`:
    hang_limit's for the work (default: one launch)."""
    return run_limited(
        [sys.executable, "-m", "trainwise", *args],
        what=f"`trainwise {' '.join(args[:6])}{' ...' if len(args) > 6 else ''}` in {cwd}",
        limit=hang_limit() if timeout is None else timeout,
        cwd=cwd,
        env={**cli_env(), **(env or {})},
    )


def run_main(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`trainwise ARGS` through the CLI's main in this process, in `cwd` with `env` added, its
    output captured: for a command that starts no worker (export, report, plan, data
    prepare, checkpoints, a refusal), where a process of its own would prove nothing more
    and cost a start-up (torch's imports) under load. run_cli when the process matters (a
    launch, the exit status the shell sees: test_cli, test_reshard, test_trust). It changes
    the process's folder, environment and sys.stdout / sys.stderr while it runs: never from
    a fixture's threads (run_cli there)."""
    from trainwise.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    here, before = Path.cwd(), {name: os.environ.get(name) for name in env or {}}
    try:
        os.chdir(cwd)
        os.environ.update(env or {})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(args))
            except SystemExit as stop:  # argparse's errors and --help
                status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    finally:
        os.chdir(here)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return subprocess.CompletedProcess(["trainwise", *args], status, out.getvalue(), err.getvalue())


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tiny_llama(
    folder: Path,
    *,
    tie: bool = False,
    seed: int = 0,
    vocab: int = 97,
    positions: int = 64,
    layers: int = 2,
    **save: object,
) -> Path:
    """A Hugging Face Llama of `layers` layers (hidden 32, GQA 4/2 heads) with random
    weights, saved by transformers' save_pretrained (`save`: its options), with a fixed
    batch of inputs beside it (idx.pt) and the logits transformers gives for it
    (logits.pt). No download."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, rms_norm_eps=1e-5, max_position_embeddings=positions,
        tie_word_embeddings=tie, rope_theta=5000.0,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder, **save)
    idx = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        torch.save(model(input_ids=idx).logits, folder / "logits.pt")
    torch.save(idx, folder / "idx.pt")
    return folder


def tiny_moe(
    folder: Path, *, family: str = "qwen3_moe", seed: int = 0, vocab: int = 97, **config: object
) -> Path:
    """A Hugging Face Mixture-of-Experts model of `family` (Qwen3-MoE: q/k norms, heads of
    16 on a width of 32; or Mixtral), 2 layers of 4 experts top-2, random weights, saved by
    save_pretrained (each expert's projections its own tensors on disk), with a fixed batch
    (idx.pt) and the logits transformers gives for it (logits.pt). `config`: overrides."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    if family == "qwen3_moe":
        made = transformers.Qwen3MoeConfig(**{
            **common, "head_dim": 16, "intermediate_size": 64, "moe_intermediate_size": 16,
            "num_experts": 4, "norm_topk_prob": True, **config})
    else:
        made = transformers.MixtralConfig(**{
            **common, "intermediate_size": 16, "num_local_experts": 4, "sliding_window": None,
            **config})
    model = transformers.AutoModelForCausalLM.from_config(made).eval()
    model.save_pretrained(folder)
    idx = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        torch.save(model(input_ids=idx).logits, folder / "logits.pt")
    torch.save(idx, folder / "idx.pt")
    return folder


def max_rel_diff(a: list[float], b: list[float], steps: int) -> float:
    """The largest relative difference of two runs' per-step losses (both `steps` long)."""
    assert len(a) == len(b) == steps
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# A prompt/response corpus whose examples differ in length (packing has work to do).
SFT_EXAMPLES = [
    {"prompt": f"Q{i}: {'what is ' * (i % 4)}{i} + {i}?", "response": f" {2 * i}." * (1 + i % 3)}
    for i in range(40)
]
SFT_SEQ = 128


def prompt_response_corpus(root: Path, name: str, examples: list[dict]) -> Path:
    """`examples` ({"prompt": ..., "response": ...}) written to root/NAME.jsonl and
    prepared with the byte tokenizer into root/NAME (prompt / response)."""
    from trainwise.data.prepare import load_tokenizer, prepare

    src = root / f"{name}.jsonl"
    src.write_text("".join(json.dumps(e) + "\n" for e in examples))
    prepare([src], root / name, load_tokenizer("bytes"), field="prompt", response_field="response")
    return root / name


def sft_corpus(root: Path) -> Path:
    """SFT_EXAMPLES prepared into root/sft."""
    return prompt_response_corpus(root, "sft", SFT_EXAMPLES)


def cut_prompt_corpus(root: Path) -> Path:
    """60 examples prepared into root/cut, every third prompt over 60 bytes: cut to a
    sequence of 32 inside its prompt, its sample has no counted target."""
    examples = [{"prompt": f"Q{i} " * (30 if i % 3 == 0 else 1), "response": f" {i}."}
                for i in range(60)]
    return prompt_response_corpus(root, "cut", examples)


# What trains on cut_prompt_corpus one example a step (seq_len 32, no packing).
CUT_PROMPT_JOB = ["--set", "data.dataset=tokens", "--set", "data.seq_len=32", "--set",
                  "data.micro_batch=1", "--set", "data.packing=false", "--set",
                  "data.val_fraction=0.2", "--set", "checkpoint.enabled=false"]


def memory_of(
    w, strategy: str, world: int, *, shard: str = "full", cpu_offload: bool = False,
    shard_degree: int | None = None, device: str = "cpu", grad_accum: int = 1, tp: int = 1,
):
    """estimate_memory of workload `w` for a strategy word over `world` data-parallel
    ranks, `tp`-way tensor parallel on each; fsdp and hsdp shard over groups of
    `shard_degree` (default the world), replicated across. The tests' shorthand for the
    layout value (estimate_memory takes a Setup)."""
    from trainwise.config.parallel_dims import ParallelDims
    from trainwise.plan.estimate import Setup
    from trainwise.plan.model.memory import estimate_memory

    if strategy in ("single", "ddp"):
        dims = ParallelDims(dp_replicate=world, tp=tp)
    elif strategy in ("fsdp", "hsdp"):
        d = shard_degree or world
        dims = ParallelDims(
            world // d, d, tp, fsdp=True, reshard_after_forward=shard == "full",
            cpu_offload=cpu_offload,
        )
    else:
        dims = ParallelDims.from_strategy(strategy, world)  # raises: no such layout
    return estimate_memory(w, Setup.of(dims, w, grad_accum), device)
