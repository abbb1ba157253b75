"""The runtime options a published run names, as job keys: the RMSNorm's kernels
(model.norm_impl) and the optimizer's step (optim.implementation) run as asked and are
priced; the planner's keys for a run's other kernels and hardware (plan.loss_kernel,
plan.attention_kernel, cluster.hbm_gbps, cluster.sustained_clock_mhz) change what they
say; when the headroom alone decides, the plan says which headroom admits the run."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest
import torch
from torch import nn

from trainwise.api import plan_job
from trainwise.cli.main import build_parser
from trainwise.cli.plan import job_spec
from trainwise.config import load_config
from trainwise.config.schema import OptimConfig
from trainwise.errors import ConfigError, ModelError
from trainwise.models import GPT, PRESETS, ModelSpec, build_model
from trainwise.models.gpt import CompositeRMSNorm
from trainwise.plan.estimate import evaluate
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.run.engine.optim import build_optimizer

SMALL = replace(PRESETS["small"], n_layer=2)  # rmsnorm, swiglu, rope, GQA


def inputs(**keys: object):
    return resolve_inputs(load_config(None, {**PLAN_DEFAULTS, **keys}))


def fsdp_row(**keys: object):
    """llama-7b on 8 H100, one micro-batch of 4096 tokens a GPU a step, no checkpointing."""
    base = {"plan.gpus": 8, "parallel.ac": "none", "data.global_batch": 8}
    return evaluate(inputs(**{**base, **keys}), "fsdp-full")


# -- model.norm_impl ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_composite_rmsnorm_computes_what_the_fused_one_does(dtype: torch.dtype):
    torch.manual_seed(0)
    fused, composite = nn.RMSNorm(64, eps=1e-5), CompositeRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        fused.weight.uniform_(0.5, 1.5)
    composite.load_state_dict(fused.state_dict())  # the same parameter, the same name
    x = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)
    y, z = fused.to(dtype)(x), composite.to(dtype)(x)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(z, y, rtol=tol, atol=tol)
    gy, gz = torch.autograd.grad(y.sum(), x)[0], torch.autograd.grad(z.sum(), x)[0]
    torch.testing.assert_close(gz, gy, rtol=tol, atol=tol)


def test_a_composite_gpt_trains_like_the_fused_one():
    torch.manual_seed(0)
    fused = GPT(SMALL)
    composite = GPT(SMALL, norm_impl="composite")
    composite.load_state_dict(fused.state_dict())
    norms = [m for m in composite.modules() if isinstance(m, nn.RMSNorm)]
    assert norms and all(isinstance(m, CompositeRMSNorm) for m in norms)
    idx = torch.randint(0, SMALL.vocab_size, (2, 16))
    torch.testing.assert_close(composite(idx), fused(idx), rtol=1e-5, atol=1e-5)


def test_the_job_key_builds_the_composite_norm_and_refuses_where_it_cannot():
    bundle = build_model(ModelSpec("small", norm_impl="composite"))
    assert isinstance(bundle.module.norm, CompositeRMSNorm)
    with pytest.raises(ModelError, match="norm_impl = 'composite' is RMSNorm's"):
        build_model(ModelSpec("tiny", norm_impl="composite"))  # LayerNorm
    with pytest.raises(ModelError, match="applies to trainwise's GPT"):
        build_model(ModelSpec("mlp", in_features=4, num_classes=2, norm_impl="composite"))


def test_the_planner_prices_the_composite_chain():
    fused, composite = fsdp_row(), fsdp_row(**{"model.norm_impl": "composite"})
    assert composite.step.compute > fused.step.compute  # its bytes and dispatches
    assert composite.memory.activations > fused.memory.activations  # its fp32 copies
    compiled = fsdp_row(**{"model.norm_impl": "composite", "train.compile": True})
    assert compiled.step.compute < composite.step.compute  # Inductor fuses the chain


def test_the_planner_refuses_the_composite_chain_where_the_runtime_does():
    with pytest.raises(ConfigError, match="LayerNorm|layernorm"):
        inputs(**{"model.name": "gpt2-124m", "model.norm_impl": "composite"})
    with pytest.raises(ConfigError, match="applies to trainwise's GPT"):
        inputs(**{"plan.params": 7_000_000_000, "model.norm_impl": "composite"})


# -- optim.implementation ----------------------------------------------------------------


@pytest.mark.parametrize("implementation, fused, foreach", [
    (None, True, None), ("fused", True, None), ("foreach", False, True),
    ("for-loop", False, False),
])
def test_the_optimizer_runs_the_step_asked(
    implementation: str | None, fused: bool, foreach: bool | None
):
    # AdamW's unset step resolves to fused (torchtitan's default); SGD's stays torch's.
    model = nn.Linear(4, 4)
    adamw = build_optimizer([model], OptimConfig(implementation=implementation))
    assert bool(adamw.defaults["fused"]) is fused
    assert adamw.defaults["foreach"] is foreach
    if implementation != "fused":
        sgd = build_optimizer([model], OptimConfig(name="sgd", implementation=implementation))
        assert not sgd.defaults["fused"]
        assert sgd.defaults["foreach"] is foreach


def test_fused_sgd_is_refused_and_the_old_foreach_key_still_loads():
    with pytest.raises(ValueError, match="runs AdamW only"):
        OptimConfig(name="sgd", implementation="fused")
    assert OptimConfig(foreach=False).implementation == "for-loop"
    assert OptimConfig(foreach=True).implementation == "foreach"
    assert OptimConfig(foreach=None).implementation == "fused"
    assert OptimConfig(name="sgd").implementation is None  # torch's choice by device
    with pytest.raises(ValueError, match="both set"):
        OptimConfig(foreach=True, implementation="fused")


def test_fused_adamw_matches_the_per_tensor_loop():
    # The same math in one kernel: 20 steps of a small model agree to float rounding.
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [build_optimizer([net], OptimConfig(implementation=kind, weight_decay=0.1))
            for net, kind in zip(nets, ("fused", "for-loop"), strict=True)]
    x = torch.randn(32, 8)
    for _ in range(20):
        for net, opt in zip(nets, opts, strict=True):
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_only_the_foreach_step_has_a_temporary_of_every_parameter():
    # MPT-30B on 8 GPUs with full checkpointing: its states peak at the optimizer step,
    # where foreach AdamW adds an fp32 temporary of every parameter on the rank; the
    # per-tensor loop and the fused kernel do not.
    keys = {"model.name": "mpt-30b", "data.seq_len": 2048, "parallel.ac": "full",
            "data.global_batch": 8}
    foreach = fsdp_row(**keys, **{"optim.implementation": "foreach"})
    per_rank = inputs(**keys).workload.params / 8
    assert foreach.memory.phase == "optimizer step"
    assert foreach.memory.buffers == pytest.approx(4 * per_rank, rel=0.01)
    for kind in ("for-loop", "fused"):
        other = fsdp_row(**keys, **{"optim.implementation": kind})
        assert other.memory.phase != "optimizer step"
        assert foreach.memory.total - other.memory.total > 4 * per_rank / 3


# -- planner keys of a run's kernels and hardware ---------------------------------------


def test_a_fused_loss_keeps_less_and_runs_faster():
    llama3 = {"model.name": "llama3-8b", "data.seq_len": 8192}  # its head backward peaks
    standard = fsdp_row(**llama3)
    fused = fsdp_row(**llama3, **{"plan.loss_kernel": "fused"})
    assert standard.memory.phase == "head backward"
    assert fused.step.compute < standard.step.compute
    assert fused.memory.total < standard.memory.total


def test_an_fp32_loss_keeps_its_three_tensors_in_fp32():
    # torchtitan's 2024 loss (logits upcast to fp32, eager) under FSDP's bf16: the head's
    # backward holds three fp32 tensors over the vocabulary instead of bf16 ones, 6 bytes
    # more an entry and token (8192 x 128,256 of them, with 5 % fragmentation); its
    # compute is priced as the standard loss's (the upcast chain).
    llama3 = {"model.name": "llama3-8b", "data.seq_len": 8192}
    standard = fsdp_row(**llama3)
    fp32 = fsdp_row(**llama3, **{"plan.loss_kernel": "fp32"})
    assert fp32.memory.phase == "head backward"
    more = fp32.memory.total - standard.memory.total
    assert more == pytest.approx(1.05 * 6 * 8192 * 128256, rel=1e-6)
    assert fp32.step.compute == standard.step.compute


def test_fused_attention_is_priced_on_hopper():
    sdpa, fused = fsdp_row(), fsdp_row(**{"plan.attention_kernel": "fused"})
    assert fused.step.compute < sdpa.step.compute


def test_the_memory_bandwidth_key_replaces_the_catalogs():
    slow = inputs(**{"cluster.hbm_gbps": 2400})
    assert slow.hardware.hbm_bps == 2400e9 and "custom figures" in slow.hardware.gpu
    assert fsdp_row(**{"cluster.hbm_gbps": 2400}).step.compute > fsdp_row().step.compute


def test_the_sustained_clock_scales_the_tensor_cores_not_the_peak():
    at_reference = fsdp_row(**{"cluster.sustained_clock_mhz": 1466})
    assert at_reference.step.compute == pytest.approx(fsdp_row().step.compute, rel=1e-9)
    half = inputs(**{"cluster.sustained_clock_mhz": 733})
    assert half.hardware.clock_scale == pytest.approx(0.5)
    assert half.hardware.peak_flops == inputs().hardware.peak_flops  # MFU's denominator
    slow = fsdp_row(**{"cluster.sustained_clock_mhz": 733})
    assert 1.3 < slow.step.compute / at_reference.step.compute < 2.0  # GEMMs, not memory
    with pytest.raises(ConfigError, match="no clock is known"):
        inputs(**{"cluster.gpu": "A100-80GB", "cluster.sustained_clock_mhz": 1200})


# -- the headroom ----------------------------------------------------------------------


def plan_line(line: str):
    args = build_parser().parse_args(shlex.split(line)[1:])
    return plan_job(job_spec(args), calibrate="none")


def test_when_the_headroom_decides_the_plan_says_which_admits_the_run():
    # Llama 2 13B without checkpointing on 64 A100 80GB at micro-batch 2 with its fp32 loss
    # (torchtitan ran it): about 78 of 85.2 GB, inside the memory, not inside a 10 % headroom.
    line = ("trainwise plan --model llama-13b --gpus 64 --gpu A100-80GB --seq 4096 "
            "--micro-batch 2 --global-batch 128 --strategy fsdp-full --set parallel.tp=1 "
            "--ac none --set plan.loss_kernel=fp32 --headroom 0.1")
    plan = plan_line(line)
    choice = plan.planned.recommendation.choice
    assert not choice.fits
    admits = float(choice.why.rsplit("--headroom ", 1)[1].split()[0])
    assert "but not with the 10% headroom kept free" in choice.why
    said = [r for r in plan.recommendation.reasons if "headroom kept free" in r]  # the output
    assert len(said) == 1 and f"--headroom {admits:g} admits it" in said[0]
    assert plan_line(line.replace("--headroom 0.1", f"--headroom {admits}")).planned \
        .recommendation.choice.fits
    assert not plan_line(line.replace("--headroom 0.1", f"--headroom {admits + 0.02:.2f}")) \
        .planned.recommendation.choice.fits


def test_a_pinned_batch_that_no_larger_count_runs_is_no_crash():
    # Nothing fits and the pinned global batch, micro-batch and accumulation run on no
    # multiple of the GPUs: the smallest changes skip those counts.
    plan = plan_line("trainwise plan --model llama-70b --gpus 8 --micro-batch 1 "
                     "--global-batch 8 --set data.grad_accum=1 --strategy fsdp-full "
                     "--set parallel.tp=1 --ac none")
    assert not plan.planned.recommendation.choice.fits


@pytest.mark.parametrize(("model", "tp", "refused"), [
    ("tiny", 1, "is RMSNorm's fp32 chain"),  # LayerNorm
    ("tiny", 2, "is RMSNorm's fp32 chain"),
    ("moe-tiny", 2, "runs its own norms"),
    ("small", 1, None),  # RMSNorm: the composite chain builds
])
def test_the_launcher_refuses_what_the_build_would_before_any_worker(model, tp, refused):
    # models.registry.norm_impl_problems reads the name and the shape (nothing built): the
    # refusal comes from prepare_job, in the launcher, at any tp.
    from trainwise.hardware import detect_device
    from trainwise.run.job.resolve import prepare_job

    cfg = load_config(overrides=[f"model.name='{model}'", f"parallel.tp={tp}",
                                 "model.norm_impl='composite'"])
    if refused is None:
        assert prepare_job(cfg, 2, detect_device("cpu"), 2).dims.tp == tp
        return
    with pytest.raises(ConfigError, match=refused):
        prepare_job(cfg, 2, detect_device("cpu"), 2)
