"""The float8 converter (models.float8): which Linears it turns into torchao's Float8Linear
(the one rule the planner prices too), torchao's config for the recipe, the layout and the
device, that the emulated GEMMs really quantize, the refusals of what it does not train
(one line each, before any worker), and that only a float8 job imports torchao."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from helpers import hang_limit
from trainwise.cli.main import main
from trainwise.config import load_config
from trainwise.config.parallel_dims import ParallelDims
from trainwise.errors import ConfigError
from trainwise.hardware import DeviceInfo
from trainwise.models import GPT, PRESETS
from trainwise.models.converters import build_converters, convert, place
from trainwise.models.float8.convert import Float8Converter, converted_names
from trainwise.models.float8.rule import eligible
from trainwise.models.shapes import GPTShape
from trainwise.plan.model.float8 import float8_linears
from trainwise.plan.model.lora import block_linears
from trainwise.run.job.resolve import machine_problems, prepare_job

CPU = DeviceInfo("cpu", "cpu", 1, 64e9, bf16=True, fp16=False, gpu=None)
# Width 48 and FFN 72: the MLP's projections (72 is no multiple of 16) stay in high precision.
ODD = GPTShape(n_layer=2, d_model=48, n_head=3, n_kv_head=3, d_ff=72, vocab_size=64,
               max_seq_len=32, norm="rmsnorm", mlp="swiglu", pos="rope",
               tie_embeddings=False, bias=False)


def _converted(shape: GPTShape, recipe: str = "tensorwise") -> GPT:
    torch.manual_seed(0)
    model = GPT(shape)
    convert(model, build_converters(load_config(overrides=[f"precision.float8='{recipe}'"])))
    return model


@pytest.mark.parametrize(("name", "dims", "want"), [
    ("blocks.0.attn.q_proj", (64, 64), True),
    ("blocks.0.mlp.up", (64, 72), False),  # 72: no float8 GEMM
    ("lm_head", (64, 256), False),  # the output head keeps its precision
    ("model.output", (4096, 128256), False),
    ("head", (64, 16), False),
])
def test_the_rule(name, dims, want):
    assert eligible(name, *dims) is want


def test_block_linears_convert_and_the_head_stays():
    from torchao.float8.float8_linear import Float8Linear

    model = _converted(ODD)
    f8 = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert f8 == set(converted_names(_converted(ODD)))  # converted_names: what convert does
    assert "blocks.0.attn.q_proj" in f8 and "blocks.1.attn.out_proj" in f8
    assert not any(".mlp." in n for n in f8) and "lm_head" not in f8
    assert type(model.lm_head) is nn.Linear and type(model.blocks[0].mlp.up) is nn.Linear


@pytest.mark.parametrize("shape", [ODD, PRESETS["tiny"], PRESETS["small"]])
def test_the_planner_prices_the_linears_the_runtime_converts(shape):
    """plan.model.float8 asks the same rule: its float8 flags are the converted Linears."""
    from torchao.float8.float8_linear import Float8Linear

    model = _converted(shape)
    names = list(block_linears(shape, 1))
    priced = [f8 for _, _, f8 in float8_linears(shape, 1)]
    layer = dict(model.blocks[0].named_modules())
    for key, f8 in zip(names, priced, strict=True):
        assert isinstance(layer[key], Float8Linear) is f8, key


@pytest.mark.parametrize(("recipe", "granularity", "power_of_2"), [
    ("tensorwise", "TENSORWISE", False), ("rowwise", "AXISWISE", True),
])
def test_torchao_config_of_the_recipe_emulated_on_cpu(recipe, granularity, power_of_2):
    model = _converted(PRESETS["tiny"], recipe)
    config = model.blocks[0].attn.q_proj.config
    assert config.emulate  # no float8 tensor cores on a CPU
    assert config.cast_config_weight.scaling_granularity.name == granularity
    assert config.round_scales_to_power_of_2 is power_of_2
    assert not config.enable_fsdp_float8_all_gather  # not placed under FSDP


@pytest.mark.parametrize(("dims", "all_gather", "gathers"), [
    (ParallelDims(dp_shard=2, fsdp=True), True, True),
    (ParallelDims(dp_shard=2, fsdp=True), False, False),
    (ParallelDims(dp_replicate=2), True, False),  # DDP: nothing gathered
])
def test_fsdp_float8_all_gather_only_where_fsdp_shards(dims, all_gather, gathers):
    converter = Float8Converter("tensorwise", all_gather)
    place([converter], dims, "cpu")
    model = GPT(PRESETS["tiny"])
    converter.convert(model)
    assert model.blocks[0].mlp.up.config.enable_fsdp_float8_all_gather is gathers
    assert converter.gathers_float8 is gathers


def test_emulated_float8_quantizes():
    """The converted model computes close to the plain one, but not the same: the GEMMs'
    operands went through float8 (3 mantissa bits)."""
    torch.manual_seed(0)
    plain = GPT(PRESETS["tiny"])
    converted = _converted(PRESETS["tiny"])
    converted.load_state_dict(plain.state_dict())  # the same names: Float8Linear's weight
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        a, b = plain(idx), converted(idx)
    assert not torch.equal(a, b)
    assert torch.allclose(a, b, atol=0.1, rtol=0)


@pytest.mark.parametrize(("overrides", "words"), [
    (["lora.rank=4"], "not composed with LoRA"),
    (["model.name='moe-tiny'", "parallel.strategy='fsdp'"], "grouped GEMMs"),
    (["model.name='mlp'", "data.dataset='digits'", "model.hidden=[100]"],
     "no Linear of model 'mlp' can run in float8"),
])
def test_what_float8_does_not_train_is_one_line(overrides, words):
    cfg = load_config(overrides=["precision.float8='tensorwise'", *overrides])
    with pytest.raises(ConfigError) as info:
        prepare_job(cfg, 1, CPU)
    (line,) = [p for p in info.value.problems if "float8" in p]
    assert line.startswith("precision.float8 = 'tensorwise'") and words in line
    assert "precision.float8 = 'none'" in line  # the fix


def test_a_gpu_without_float8_tensor_cores_is_refused():
    a100 = DeviceInfo("cuda", "NVIDIA A100", 8, 80e9, True, True, None, capability=(8, 0))
    h100 = DeviceInfo("cuda", "NVIDIA H100", 8, 80e9, True, True, None, capability=(9, 0))
    cfg = load_config(overrides=["precision.float8='rowwise'", "precision.dtype='bf16'"])
    (line,) = machine_problems(cfg, a100, 1)[1]
    assert "compute capability 8.9+" in line and "has 8.0" in line
    assert machine_problems(cfg, h100, 1)[1] == []


def test_train_cli_refuses_float8_with_lora_before_any_worker(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(["train", "--set", "cluster.device='cpu'", "--set", "precision.float8='rowwise'",
               "--set", "lora.rank=4", "--run-dir", str(run_dir)])
    assert rc == 2 and not run_dir.exists()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("trainwise: error: precision.float8 = 'rowwise' with lora.rank = 4")


@pytest.mark.timeout(hang_limit())
def test_only_a_float8_job_imports_torchao():
    """torchao logs at import (CUDA libraries it cannot load): a job without float8, the
    planner and a bad-input line never load it."""
    code = (
        "import sys\n"
        "from trainwise.config import load_config\n"
        "from trainwise.hardware import DeviceInfo\n"
        "from trainwise.models.converters import build_converters\n"
        "from trainwise.run.job.resolve import prepare_job\n"
        "import trainwise.plan.model.float8\n"
        "cpu = DeviceInfo('cpu', 'cpu', 1, 64e9, bf16=True, fp16=False, gpu=None)\n"
        "cfg = load_config()\n"
        "prepare_job(cfg, 1, cpu)\n"
        "assert build_converters(cfg) == []\n"
        "assert 'torchao' not in sys.modules\n"
        "build_converters(load_config(overrides=[\"precision.float8='tensorwise'\"]))\n"
        "assert 'torchao' not in sys.modules  # the converter imports it when it converts\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=hang_limit())
    assert res.returncode == 0, res.stderr[-2000:]
    assert "torchao" not in res.stderr
