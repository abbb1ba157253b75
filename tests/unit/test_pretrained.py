"""Pretrained Hugging Face weights into trainwise models, in one process: a tiny Llama
saved by transformers (random weights, no download) loads into the transformers model and
into trainwise's own GPT with the logits transformers gives; bad weights are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import QUIET, tiny_llama
from trainwise.cli.main import main
from trainwise.errors import ModelError
from trainwise.models import ModelSpec, build_model, count_parameters
from trainwise.models.llama import gpt_to_hf
from trainwise.models.pipeline import split_gpt
from trainwise.run.engine.materialize import allocate

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 97  # tiny_llama's


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "untied": tiny_llama(root / "untied"),
        "tied": tiny_llama(root / "tied", tie=True, seed=1),
        "sharded": tiny_llama(root / "sharded", seed=2, max_shard_size="20KB"),
    }


def _logits(folder: Path, impl: str, **spec: object) -> torch.Tensor:
    bundle = build_model(ModelSpec(name=f"hf:{folder}", seq_len=16, impl=impl, **spec))
    assert bundle.load_weights is not None
    bundle.load_weights(bundle.module)
    with torch.no_grad():
        return bundle.module.eval()(torch.load(folder / "idx.pt"))


@pytest.mark.parametrize("impl", ["transformers", "trainwise"])
@pytest.mark.parametrize("which", ["untied", "tied", "sharded"])
def test_logits_equal_transformers(models, which, impl):
    folder = models[which]
    if which == "sharded":
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 1
    got, want = _logits(folder, impl), torch.load(folder / "logits.pt")
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_meta_build_allocated_then_loaded_equals_transformers(models, which):
    """The trainer's pretrained path: built on meta, storage allocated with no random
    draws (the rope tables rebuilt), every parameter then filled by the load."""
    folder = models[which]
    with torch.device("meta"):
        bundle = build_model(ModelSpec(name=f"hf:{folder}", seq_len=16, impl="trainwise"))
    allocate(bundle.module, torch.device("cpu"))
    bundle.load_weights(bundle.module)
    with torch.no_grad():
        got = bundle.module.eval()(torch.load(folder / "idx.pt"))
    want = torch.load(folder / "logits.pt")
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def test_random_init_ignores_weights(models):
    bundle = build_model(ModelSpec(name=f"hf:{models['untied']}", seq_len=16, init="random"))
    assert bundle.load_weights is None


def test_gpt_names_cover_every_llama_weight(models):
    gpt = build_model(ModelSpec(name=f"hf:{models['untied']}", seq_len=16, impl="trainwise"))
    names = {gpt_to_hf(n) for n in gpt.module.state_dict()}
    stored = json.loads((models["sharded"] / "model.safetensors.index.json").read_text())
    assert names == set(stored["weight_map"])
    # The GPT's shape comes from config.json: the planner counts the same parameters.
    spec = ModelSpec(name=f"hf:{models['untied']}", seq_len=16, impl="trainwise")
    assert count_parameters(spec) == sum(p.numel() for p in gpt.module.parameters())


def test_bf16_weights_convert_on_load(tmp_path):
    folder = tiny_llama(tmp_path / "bf16", seed=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model.save_pretrained(folder)  # the same weights, stored as bf16
    got = _logits(folder, "trainwise")
    with torch.no_grad():
        want = model.float()(input_ids=torch.load(folder / "idx.pt")).logits
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def _edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = safetensors_torch.load_file(path)
    edit(tensors)
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "no 'model.layers.1.mlp.up_proj.weight'"),
        (lambda t: t.update(extra=torch.zeros(3)), "hold 'extra', which the model does not have"),
        (lambda t: t.update({"model.norm.weight": torch.ones(31)}), "'model.norm.weight' has shape [31]"),
    ],
)
@pytest.mark.parametrize("impl", ["transformers", "trainwise"])
def test_weights_that_do_not_match_name_the_key(tmp_path, edit, message, impl):
    folder = tiny_llama(tmp_path / "m")
    _edit_weights(folder, edit)
    with pytest.raises(ModelError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_model(ModelSpec(name=f"hf:{folder}", seq_len=16, impl=impl))


def test_vocab_larger_than_the_models_is_refused(models):
    spec = ModelSpec(name=f"hf:{models['untied']}", vocab_size=VOCAB + 1, seq_len=16)
    with pytest.raises(ModelError, match=f"token ids up to {VOCAB}.*vocab_size is {VOCAB}"):
        build_model(spec)


@pytest.fixture(scope="module")
def broken(models, tmp_path_factory) -> dict[str, Path]:
    """Model directories a user can get wrong, for the CLI."""
    root = tmp_path_factory.mktemp("broken")
    no_config = root / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes(
        (models["untied"] / "model.safetensors").read_bytes()
    )
    mismatched = root / "mismatched"  # the weights of one model, the config of another
    mismatched.mkdir()
    config = json.loads((models["untied"] / "config.json").read_text())
    (mismatched / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    (mismatched / "model.safetensors").write_bytes(
        (models["untied"] / "model.safetensors").read_bytes()
    )
    no_weights = root / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(config))
    return {"no_config": no_config, "mismatched": mismatched, "no_weights": no_weights}


@pytest.mark.parametrize(
    ("which", "sets", "message"),
    [
        ("no_config", [], "no config file at"),
        ("mismatched", [], "'model.layers.0.mlp.gate_proj.weight' has shape [64, 32] in the weights but [48, 32]"),
        ("no_weights", ["model.init=pretrained"], "holds no model.safetensors"),
        ("untied", ["data.vocab_size=200"], "token ids up to 199 but the model's vocab_size is 97"),
    ],
)
def test_cli_bad_model_one_line_exit_2(models, broken, tmp_path, capsys, which, sets, message):
    """`trainwise train`'s main in this process (the refusal comes before any worker, so a
    process of its own would prove no more): one line, status 2, no run directory."""
    folder = {**models, **broken}[which]
    extra = [a for kv in sets for a in ("--set", kv)]
    run_dir = tmp_path / "run"
    rc = main([
        "train", *QUIET, "--set", f"model.name='hf:{folder}'", "--set", "train.steps=1",
        "--set", "parallel.strategy=single", "--set", "data.seq_len=16",
        "--set", f"data.vocab_size={VOCAB}", "--run-dir", str(run_dir), *extra,
    ])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err[-2000:]
    assert not run_dir.exists()


def _stage(folder: Path, stage: int) -> torch.nn.Module:
    """Stage `stage` of 2 of the trainwise GPT as the trainer builds it: cut from the meta
    model by the splitter, storage allocated, not yet loaded."""
    with torch.device("meta"):
        gpt = build_model(ModelSpec(name=f"hf:{folder}", seq_len=16, impl="trainwise")).module
    part = split_gpt(gpt, stage, 2)
    allocate(part, torch.device("cpu"))
    return part


def test_each_pipeline_stage_reads_only_its_own_tensors(models):
    """Two stages of a sharded checkpoint: each opens exactly the tensors it holds (its
    blocks; the embedding on the first, the norm and head on the last), and together they
    read every tensor of the files once, with the files' values."""
    folder = models["sharded"]
    stored = {}
    for f in folder.glob("*.safetensors"):
        stored.update(safetensors_torch.load_file(f))
    bundle = build_model(ModelSpec(name=f"hf:{folder}", seq_len=16, impl="trainwise"))
    reads = []
    for stage in (_stage(folder, 0), _stage(folder, 1)):
        read = bundle.load_weights(stage)
        mine = {gpt_to_hf(k): v for k, v in stage.state_dict().items() if "rotary" not in k}
        assert read["tensors_read"] == len(mine), (read, sorted(mine))
        assert read["bytes_read"] == sum(stored[k].nbytes for k in mine)
        assert all(torch.equal(v, stored[k]) for k, v in mine.items())
        reads.append(read)
    assert sum(r["tensors_read"] for r in reads) == len(stored)
    assert sum(r["bytes_read"] for r in reads) == sum(t.nbytes for t in stored.values())
