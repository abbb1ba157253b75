"""Hugging Face MoE directories read into trainwise's MoE model (models/moe/hf.py): a
tiny Qwen3-MoE and a tiny Mixtral saved by transformers give transformers' logits in one
process; the names both ways; what exports as which family; what cannot be read."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from helpers import tiny_moe
from trainwise.errors import ModelError
from trainwise.models import ModelSpec, build_model, resolve_moe_shape, resolve_shape
from trainwise.models.moe import MOE_PRESETS
from trainwise.models.moe.hf import export_family, hf_names, shape_from_config, split_for_hf

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_pretrained_weights_give_transformers_logits(tmp_path, family):
    folder = tiny_moe(tmp_path / family, family=family)
    spec = ModelSpec(name=f"hf:{folder}", impl="trainwise", seq_len=64)
    assert resolve_shape(spec) is None and resolve_moe_shape(spec).moe.experts == 4
    bundle = build_model(spec)
    read = bundle.load_weights(bundle.module)
    assert read["tensors_read"] > 2 * 4 * 3  # every expert's projections, one by one
    with torch.no_grad():
        got = bundle.module.eval()(torch.load(folder / "idx.pt"))
    want = torch.load(folder / "logits.pt")
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def test_names_both_ways():
    assert hf_names("blocks.3.moe.experts.up_proj", "mixtral", 2) == [
        "model.layers.3.block_sparse_moe.experts.0.w3.weight",
        "model.layers.3.block_sparse_moe.experts.1.w3.weight"]
    assert hf_names("blocks.0.moe.router.gate.weight", "qwen3_moe", 8) == [
        "model.layers.0.mlp.gate.weight"]
    assert hf_names("blocks.0.moe.router.expert_bias", "qwen3_moe", 8) == []
    weight = torch.arange(2 * 3 * 4.0).view(2, 3, 4)
    pairs = dict(split_for_hf("blocks.1.moe.experts.down_proj", weight, "qwen3_moe"))
    assert torch.equal(pairs["model.layers.1.mlp.experts.1.down_proj.weight"], weight[1])


def test_export_families():
    assert export_family(MOE_PRESETS["qwen3-30b-a3b"]) == "qwen3_moe"
    assert export_family(MOE_PRESETS["mixtral-8x7b"]) == "mixtral"
    assert export_family(MOE_PRESETS["moe-tiny"]) is None  # an ungated shared expert
    sigmoid = MOE_PRESETS["qwen3-30b-a3b"]
    assert export_family(replace(sigmoid, moe=replace(sigmoid.moe, score="sigmoid"))) is None


def test_what_the_model_cannot_reproduce_is_one_line_each(tmp_path):
    folder = tiny_moe(tmp_path / "q", family="qwen3_moe")
    config = json.loads((folder / "config.json").read_text())
    bad = {**config, "hidden_act": "gelu", "decoder_sparse_step": 2}
    with pytest.raises(ModelError) as err:
        shape_from_config(bad, "here")
    assert len(err.value.problems) == 2 and all(p.startswith("here: ") for p in err.value.problems)
    dense = shape_from_config({**config, "mlp_only_layers": [0]}, "here")
    assert (dense.moe.dense_layers, dense.moe.d_dense) == (1, 64)
