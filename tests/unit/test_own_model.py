"""Your own model, planned (issue 33): a module read on the meta device
(trainwise.models.profile) is priced as the preset of its shape when it is a GPT, else by
its blocks (the FSDP units the runtime wraps), its Linear GEMMs and what a micro-batch of
it measured on fake tensors; a factory that fails is one line. The modules are the tests'
own code (tests/own_models.py), written without trainwise."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import own_models
from trainwise.config import load_config
from trainwise.config.load import load_job
from trainwise.errors import ModelError
from trainwise.hardware import GB, DeviceInfo
from trainwise.models.blocks import RULE_RUN, find_blocks
from trainwise.models.profile import profile_model
from trainwise.models.registry import ModelSpec, build_model
from trainwise.models.shapes import job_shape
from trainwise.plan.inputs import PLAN_DEFAULTS, resolve_inputs
from trainwise.plan.model.flops import matmul_params, profile_flops_per_token
from trainwise.plan.model.memory import block_params
from trainwise.plan.planner import make_plan
from trainwise.run.job.resolve import prepare_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CPU = DeviceInfo("cpu", "cpu", 1, 64 * GB, bf16=True, fp16=False, gpu=None)
# (factory, the preset of its shape, sequence length)
LIKE_PRESETS = [
    ("own_models:llama_7b", "llama-7b", 4096),
    ("own_models:gpt2_124m", "gpt2-124m", 1024),
    ("own_models:llama_small", "small", 256),
]
# The byo example's conv net at depth 4: a block (LayerNorm 64 + Linear 64->256 +
# Linear 256->64) has 128 + 16,640 + 16,448 parameters; the stem (8 x 3 + 8), the
# projection (512 x 64 + 64) and the head (64 x 10 + 10) lie outside the blocks.
BLOCK, OUTER = 33_216, 32 + 32_832 + 650


def plan_for(keys: dict, profile=None):
    cfg, _ = load_job(None, keys, [], base=PLAN_DEFAULTS)
    return make_plan(resolve_inputs(cfg, profile))


def close(a: float, b: float, share: float = 0.01) -> bool:
    return abs(a - b) <= share * abs(b)


@pytest.mark.parametrize(("factory", "preset", "seq"), LIKE_PRESETS)
def test_a_module_shaped_like_a_preset_is_planned_as_the_preset(factory, preset, seq):
    profile = profile_model(factory, seq_len=seq)
    assert profile.shape == job_shape(preset, seq_len=seq)
    mine = plan_for({"model.name": factory, "data.seq_len": seq}, profile)
    theirs = plan_for({"model.name": preset, "data.seq_len": seq})
    rows = {s.name: s for s in theirs.strategies}
    assert mine.strategies
    for s in mine.strategies:
        assert close(s.memory.total, rows[s.name].memory.total), s.name
        assert close(s.step.total, rows[s.name].step.total), s.name
    chosen, preset_choice = mine.recommendation.choice, theirs.recommendation.choice
    # the user's module has no tensor-parallel plan and no stage split of its own
    if preset_choice.dims.tp == preset_choice.dims.pp == 1:
        assert close(chosen.plan.memory.total, preset_choice.plan.memory.total)
        assert close(chosen.plan.step.total, preset_choice.plan.step.total)
    assert chosen.dims.tp == chosen.dims.pp == 1


class SmallLlama(own_models.Llama):
    """The `small` preset's shape as a class of the test's own, built without arguments."""

    def __init__(self):
        super().__init__(256, 256, 6, 8, 4, 1024, tied=True)


def _class_in_a_function() -> type:
    class InAFunction(own_models.Llama):  # no import path names it: by value
        def __init__(self):
            super().__init__(256, 256, 6, 8, 4, 1024, tied=True)

    return InAFunction


@pytest.mark.parametrize(
    "model", [own_models.llama_small, SmallLlama, _class_in_a_function()],
    ids=["factory", "class", "class-by-value"],
)
def test_plan_from_python_prices_a_module_shaped_like_a_preset_as_the_preset(model):
    """trainwise.plan(model=...) with the object itself: every row and the choice within
    1 % of the preset's."""
    import trainwise

    mine = trainwise.plan(model=model, seq=256, gpus=2)
    theirs = trainwise.plan(model="small", seq=256, gpus=2)
    if model.__qualname__.startswith("_class_in_a_function"):
        assert mine.inputs.model.startswith("pickled:")
    assert mine.inputs.params == theirs.inputs.params
    rows = {s.name: s for s in theirs.strategies}
    assert {s.name for s in mine.strategies} == set(rows)
    for s in mine.strategies:
        assert close(s.memory_per_gpu.total, rows[s.name].memory_per_gpu.total), s.name
        assert close(s.step.total, rows[s.name].step.total), s.name
    chosen, preset = mine.recommendation, theirs.recommendation
    assert chosen.configuration == preset.configuration
    assert close(chosen.plan.memory_per_gpu.total, preset.plan.memory_per_gpu.total)
    assert close(chosen.plan.step.total, preset.plan.step.total)


def test_a_module_that_cannot_be_split_is_not_planned_with_tp_or_stages():
    profile = profile_model("own_models:llama_7b", seq_len=4096)
    keys = {"model.name": "own_models:llama_7b", "plan.max_pp": 8, "plan.gpus": 64}
    plan = plan_for(keys, profile)
    assert plan.recommendation.choice.dims.tp == 1
    assert plan.recommendation.choice.dims.pp == 1


def test_blocks_are_found_as_the_runtime_wraps_them():
    with torch.device("meta"):
        gpt2 = own_models.gpt2_124m()
        bundle = build_model(ModelSpec("own_models:gpt2_124m"))
    found = find_blocks(gpt2)
    assert (len(found.modules), found.path, found.rule) == (12, "transformer.h", RULE_RUN)
    assert len(bundle.blocks) == 12  # what FSDP and checkpointing wrap


def test_a_module_without_blocks_is_one_unit_and_the_plan_says_so():
    profile = profile_model("own_models:wide")
    assert profile.blocks == 0 and profile.run is None
    plan = plan_for({"model.name": "own_models:wide", "plan.gpus": 2}, profile)
    assert plan.inputs.workload.units == 1
    said = " ".join(plan.warnings)
    assert "priced from its parameter count as one FSDP unit" in said
    assert "activations are not counted" in said
    assert all(s.memory.activations is None for s in plan.strategies)


def test_without_a_sample_the_linears_run_once_a_token():
    """No sample run: each Linear multiplies once a token, 6 FLOPs a weight: a GPT read
    that way is its 6N less the norms' weights (no matmul) and without attention (the
    sample run adds what it counts)."""
    profile = replace(profile_model("own_models:llama_small", seq_len=256), shape=None)
    shape = job_shape("small", seq_len=256)
    norms = (2 * shape.n_layer + 1) * shape.d_model
    assert profile_flops_per_token(profile) == 6 * (matmul_params(shape) - norms)


def conv_net(monkeypatch, depth: int = 4, micro_batch: int = 32, **job):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    x, y = torch.randn(micro_batch, 64), torch.randint(0, 10, (micro_batch,))
    return profile_model(
        "byo_model:build", {"depth": depth}, sample=(x, y), micro_batch=micro_batch, **job
    )


def test_a_conv_net_is_priced_by_its_blocks_and_its_measured_run(monkeypatch):
    profile = conv_net(monkeypatch)
    assert (profile.blocks, profile.block_params, profile.outer_params) == (4, BLOCK, OUTER)
    assert profile.shape is None and profile.tokens == 1  # a token is a sample
    # The convolution (1 -> 8 channels, 3 taps, 64 positions): 2 x 8 x 3 x 64 FLOPs forward
    # and as many for its weight gradient (the input needs none), measured per sample.
    assert profile.run.other_flops == 2 * 2 * 8 * 3 * 64
    assert profile.run.activations > 0
    plan = plan_for({"model.name": "byo_model:build", "plan.gpus": 2,
                     "data.micro_batch": 32, "precision.dtype": "fp32"}, profile)
    w = plan.inputs.workload
    assert (w.units, w.seq_len) == (4, 1)
    assert block_params(w) == (BLOCK, OUTER)
    fsdp = plan.strategy("fsdp-full").memory
    run = profile.run  # fp32: FSDP's activations are single's
    held = run.activations_late if fsdp.phase == "end of a block's backward" else run.activations
    assert fsdp.activations == pytest.approx(held * 32, rel=1e-12)


def test_activations_measured_at_other_settings_are_not_counted(monkeypatch):
    profile = conv_net(monkeypatch)  # fp32, no checkpointing
    plan = plan_for({"model.name": "byo_model:build", "plan.gpus": 2, "data.micro_batch": 32,
                     "precision.dtype": "bf16"}, profile)
    assert all(s.memory.activations is None for s in plan.strategies)
    assert any("measured at fp32 with ac none, the job runs bf16" in w for w in plan.warnings)


def test_the_runtime_prices_fsdp_by_the_blocks_of_your_model(monkeypatch, tmp_path):
    """prepare_job's planner view keeps the blocks of a user's model: FSDP gathers one
    block and the next, not the whole model as one unit (which over-estimated it)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    job_file = tmp_path / "job.toml"
    job_file.write_text(
        '[model]\nname = "byo_model:build"\nkwargs = { depth = 4 }\n'
        '[data]\ndataset = "digits"\nmicro_batch = 32\n'
        '[parallel]\nstrategy = "fsdp"\n[precision]\ndtype = "fp32"\n'
    )
    job = prepare_job(load_config(job_file), 2, CPU)
    assert job.params == OUTER + 4 * BLOCK
    est = job.decision.estimate
    assert est.phase == "end of a block's backward"
    # fp32: the root gathered all along, a block in use and the next prefetched, the
    # block's unsharded gradients (the whole model as one unit: 2 x 4 x 166,378 bytes).
    assert est.buffers == 4 * (OUTER + 2 * BLOCK + BLOCK)
    assert est.activations is not None  # measured on fake tensors with a digits batch


def test_a_factory_that_raises_is_one_line_naming_it():
    with pytest.raises(ModelError) as err:
        profile_model(own_models.raises)
    (line,) = err.value.problems
    assert "own_models.raises" in line and "checkpoint file missing" in line
    assert "fix the factory" in line


def test_a_factory_that_returns_no_module_is_one_line():
    with pytest.raises(ModelError) as err:
        profile_model("own_models:not_a_module")
    (line,) = err.value.problems
    assert "own_models:not_a_module" in line and "returned a dict" in line


def test_a_model_that_is_neither_a_name_nor_a_callable_is_refused():
    with pytest.raises(ModelError, match="not a model"):
        profile_model(42)  # type: ignore[arg-type]


def test_a_transformers_llama_directory_is_read_as_its_gpt_shape(tmp_path):
    from helpers import tiny_llama

    folder = tiny_llama(tmp_path / "llama", tie=True)
    profile = profile_model(f"hf:{folder}", seq_len=64)
    shape = profile.shape
    assert shape is not None and profile.blocks == 2
    assert (shape.n_layer, shape.d_model, shape.n_head, shape.n_kv_head, shape.d_ff) == (
        2, 32, 4, 2, 64
    )
    assert (shape.vocab_size, shape.norm, shape.mlp, shape.tie_embeddings) == (
        97, "rmsnorm", "swiglu", True
    )
    assert shape.num_params() == profile.params
