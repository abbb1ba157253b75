"""Unit tests of trainwise.models: GPT shapes and parameter counts, GPT behaviour (causality,
determinism, meta construction, learning), the MLP, bring-your-own factories, the Hugging
Face path and the registry."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from dataclasses import replace

import pytest
import torch
from torch import nn

from trainwise.errors import ModelError
from trainwise.models import (
    GPT,
    PRESETS,
    GPTShape,
    MLPClassifier,
    ModelSpec,
    build_model,
    count_parameters,
    cross_entropy_loss,
    load_factory,
    model_kind,
    preset_names,
    resolve_shape,
)
from trainwise.models import gpt as gpt_module
from trainwise.models.custom import build_custom
from trainwise.models.hf import build_hf

# A small model exercising every non-GPT-2 option: untied, rmsnorm, swiglu, rope, GQA.
LLAMA_LIKE = replace(
    PRESETS["llama-1b"],
    n_layer=2,
    d_model=64,
    n_head=4,
    n_kv_head=2,
    d_ff=96,
    vocab_size=100,
    max_seq_len=32,
    tie_embeddings=False,
)


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --- shapes and counts ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        PRESETS["tiny"],
        PRESETS["small"],
        LLAMA_LIKE,
        replace(PRESETS["tiny"], tie_embeddings=False, bias=False),
        replace(PRESETS["tiny"], pos="rope", mlp="swiglu", bias=True, n_kv_head=1),
    ],
    ids=["tiny", "small", "llama-like", "tiny-untied-nobias", "tiny-rope-swiglu-bias-mqa"],
)
def test_num_params_equals_built_model(shape: GPTShape) -> None:
    assert shape.num_params() == n_params(GPT(shape))


@pytest.mark.parametrize(
    ("name", "published", "tolerance"),
    [
        ("gpt2-124m", 124_439_808, 0.0),  # exact, tied wte counted once
        ("llama-1b", 1_235_814_400, 0.0),  # Llama 3.2 1B model card: 1.23B
        ("llama-7b", 6.74e9, 0.01),
        ("llama-13b", 13.0e9, 0.01),
        ("llama-70b", 69.0e9, 0.01),
        # Llama 3.1 8B and 405B: their safetensors indexes, total_size / 2 bytes (bf16)
        ("llama3-8b", 8_030_261_248, 0.0),
        ("llama3-405b", 405_853_388_800, 0.0),
        # llm-foundry scripts/train/benchmarking/README.md, NumParams at 2,048 tokens
        ("mpt-1b", 1_315_950_592, 0.0),
        ("mpt-7b", 6_658_859_008, 0.0),
        ("mpt-30b", 29_975_214_080, 0.0),
    ],
)
def test_preset_counts_match_published(name: str, published: float, tolerance: float) -> None:
    got = PRESETS[name].num_params()
    assert abs(got - published) <= tolerance * published, f"{name}: {got:,}"


def test_count_parameters_of_llama_7b_does_not_build(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("count_parameters built the model")

    monkeypatch.setattr(gpt_module.GPT, "__init__", no_build)
    assert count_parameters(ModelSpec("llama-7b")) == PRESETS["llama-7b"].num_params()


def test_tiny_is_under_a_million_params() -> None:
    assert n_params(GPT(PRESETS["tiny"])) < 1_000_000


def test_head_dim() -> None:
    assert PRESETS["llama-70b"].head_dim == 128
    assert PRESETS["gpt2-124m"].head_dim == 64


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"d_model": 65}, "not divisible by n_head"),
        ({"n_kv_head": 3}, "not divisible by n_kv_head"),
        ({"n_layer": 0}, "n_layer = 0: must be a positive integer"),
        ({"vocab_size": -1}, "vocab_size = -1"),
        ({"norm": "batchnorm"}, "norm = 'batchnorm': must be one of layernorm, rmsnorm"),
        ({"pos": "rope", "d_model": 36, "n_head": 4}, "rope needs an even head_dim"),
    ],
)
def test_shape_validation(changes: dict, needle: str) -> None:
    with pytest.raises(ModelError, match=needle):
        replace(PRESETS["tiny"], **changes)


# --- GPT behaviour ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [PRESETS["tiny"], LLAMA_LIKE], ids=["learned", "rope"])
def test_forward_shape(shape: GPTShape) -> None:
    idx = torch.randint(0, shape.vocab_size, (3, 17))
    logits = GPT(shape)(idx)
    assert logits.shape == (3, 17, shape.vocab_size)
    assert logits.dtype == torch.float32


@pytest.mark.parametrize("shape", [PRESETS["tiny"], LLAMA_LIKE], ids=["learned", "rope"])
def test_causal(shape: GPTShape) -> None:
    torch.manual_seed(0)
    model = GPT(shape).eval()
    idx = torch.randint(0, shape.vocab_size, (2, 12))
    changed = idx.clone()
    changed[:, 7] = (idx[:, 7] + 1) % shape.vocab_size
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_rope_makes_attention_position_aware() -> None:
    # Without positions a causal model's output at the last token is order-invariant for
    # the earlier tokens; rope must break that.
    torch.manual_seed(0)
    model = GPT(LLAMA_LIKE).eval()
    idx = torch.tensor([[5, 6, 7, 8]])
    swapped = torch.tensor([[6, 5, 7, 8]])
    with torch.no_grad():
        assert not torch.allclose(model(idx)[0, -1], model(swapped)[0, -1])


def test_too_long_input_is_a_model_error() -> None:
    model = GPT(PRESETS["tiny"])
    with pytest.raises(ModelError, match="exceeds the model's max_seq_len = 128"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_same_seed_same_weights() -> None:
    def weights(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return GPT(LLAMA_LIKE).state_dict()

    first, second, other = weights(1), weights(1), weights(2)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
    assert not torch.equal(first["tok_emb.weight"], other["tok_emb.weight"])


def test_init_is_gpt2_style() -> None:
    torch.manual_seed(0)
    shape = replace(PRESETS["small"], n_layer=8, d_model=256)
    model = GPT(shape)
    block = model.blocks[0]
    assert block.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.out_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert block.mlp.down.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.equal(block.norm1.weight, torch.ones(256))
    tiny = GPT(PRESETS["tiny"])
    assert torch.equal(
        tiny.blocks[0].attn.q_proj.bias, torch.zeros_like(tiny.blocks[0].attn.q_proj.bias)
    )


def test_tied_embeddings_share_one_parameter() -> None:
    tied = GPT(PRESETS["tiny"])
    assert tied.lm_head is None
    untied = GPT(LLAMA_LIKE)
    assert untied.lm_head is not None
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_rope_tables_are_not_state() -> None:
    model = GPT(LLAMA_LIKE)
    assert not any("cos" in k or "sin" in k for k in model.state_dict())
    assert any(name.endswith("rotary.cos") for name, _ in model.named_buffers())


@pytest.mark.parametrize("shape", [PRESETS["tiny"], LLAMA_LIKE], ids=["tiny", "llama-like"])
def test_adamw_reduces_loss_on_a_fixed_batch(shape: GPTShape) -> None:
    torch.manual_seed(0)
    model = GPT(shape)
    idx = torch.randint(0, shape.vocab_size, (4, 16))
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = cross_entropy_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_llama_1b_builds_on_meta() -> None:
    with torch.device("meta"):
        model = GPT(PRESETS["llama-1b"])
    assert all(p.is_meta for p in model.parameters())
    assert n_params(model) == PRESETS["llama-1b"].num_params()
    assert len(model.blocks) == 16


def test_init_weights_after_to_empty() -> None:
    with torch.device("meta"):
        model = GPT(LLAMA_LIKE)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert not tensor.is_meta and torch.isfinite(tensor).all(), name
    # The rope tables must be rebuilt, not left as whatever to_empty allocated.
    reference = GPT(LLAMA_LIKE)
    torch.testing.assert_close(model.blocks[1].attn.rotary.cos, reference.blocks[1].attn.rotary.cos)
    torch.manual_seed(0)
    fresh = GPT(LLAMA_LIKE)
    logits = model(torch.zeros(1, 8, dtype=torch.long))
    torch.testing.assert_close(logits, fresh(torch.zeros(1, 8, dtype=torch.long)))


def test_bf16_autocast_forward() -> None:
    model = GPT(LLAMA_LIKE)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, LLAMA_LIKE.vocab_size)
    assert torch.isfinite(logits.float()).all()


# --- MLP -------------------------------------------------------------------------------------


def test_mlp_classifier() -> None:
    model = MLPClassifier(10, 3, hidden=(32, 16, 8), dropout=0.1)
    assert len(model.blocks) == 3
    assert isinstance(model.blocks[0], nn.Sequential)
    assert model(torch.randn(5, 10)).shape == (5, 3)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"in_features": 0, "num_classes": 3}, "model.in_features = 0"),
        ({"in_features": 4, "num_classes": 3, "hidden": (8, -1)}, "model.hidden"),
        ({"in_features": 4, "num_classes": 3, "dropout": 1.0}, "model.dropout = 1.0"),
    ],
)
def test_mlp_validation(kwargs: dict, needle: str) -> None:
    with pytest.raises(ModelError, match=needle):
        MLPClassifier(**kwargs)


# --- bring your own model --------------------------------------------------------------------

FACTORIES = textwrap.dedent("""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, width=4):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, 2)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    def make(width=4):
        return Net(width)

    def make_with_loss(width=4):
        return Net(width), lambda out, target: (out.sum() * 0 + 7.0)

    def make_list():
        return [Net()]

    def make_broken():
        raise ValueError("width must be even")

    NOT_CALLABLE = 42
""")


@pytest.fixture
def factories(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "tw_test_factories.py").write_text(FACTORIES)
    (tmp_path / "tw_broken_module.py").write_text("raise RuntimeError('boom at import\\nmore')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "tw_test_factories"
    for name in ("tw_test_factories", "tw_broken_module"):
        sys.modules.pop(name, None)


def test_custom_factory_returning_module(factories: str) -> None:
    bundle = build_model(ModelSpec(f"{factories}:make", kwargs={"width": 6}))
    assert bundle.module(torch.randn(3, 6)).shape == (3, 2)
    assert bundle.loss_fn is cross_entropy_loss
    assert len(bundle.blocks) == 2  # picked up from the module's `layers`
    assert bundle.shape is None


def test_custom_factory_returning_module_and_loss(factories: str) -> None:
    module, loss_fn = build_custom(f"{factories}:make_with_loss", {})
    assert isinstance(module, nn.Module)
    bundle = build_model(ModelSpec(f"{factories}:make_with_loss"))
    assert bundle.loss_fn(torch.zeros(1, 2), torch.zeros(1)).item() == 7.0


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("no_colon_here.mod", None),  # not even a custom path: unknown model name
        ("pkg.mod:", "not an import path"),
        (":factory", "not an import path"),
        ("pkg mod:factory", "not an import path"),
        ("a:b:c", "not an import path"),
        ("tw_no_such_module_xyz:make", "cannot import module 'tw_no_such_module_xyz'"),
        ("tw_broken_module:make", r"RuntimeError: boom at import\)"),
        ("tw_test_factories:missing", "has no attribute 'missing'"),
        ("tw_test_factories:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a callable"),
        ("tw_test_factories:make_list", "returned a list; it must return an nn.Module"),
        ("tw_test_factories:make_broken", "the factory raised ValueError: width must be even"),
    ],
)
def test_custom_factory_errors(factories: str, path: str, needle: str | None) -> None:
    with pytest.raises(ModelError) as info:
        build_model(ModelSpec(path))
    message = str(info.value)
    assert "\n" not in message
    if needle is None:
        assert "not a preset" in message
    else:
        assert path in message
        assert re.search(needle, message), message


def test_custom_factory_bad_kwargs(factories: str) -> None:
    with pytest.raises(ModelError, match=r"model.kwargs \['depth'\] failed"):
        build_custom(f"{factories}:make", {"depth": 3})


def test_load_factory_dotted_attribute(factories: str) -> None:
    assert load_factory(f"{factories}:Net.__init__") is sys.modules[factories].Net.__init__


def test_count_parameters_of_custom_uses_meta(factories: str) -> None:
    spec = ModelSpec(f"{factories}:make", kwargs={"width": 5})
    assert count_parameters(spec) == 5 * 5 + 5 + 5 * 2 + 2


# --- Hugging Face ----------------------------------------------------------------------------


def _write_gpt2_config(folder, **extra: object) -> None:
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_layer": 2,
                "n_embd": 32,
                "n_head": 2,
                "n_positions": 64,
                "vocab_size": 100,
                **extra,
            }
        )
    )


def test_hf_without_transformers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_gpt2_config(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ModelError) as info:
        build_model(ModelSpec(f"hf:{tmp_path}"))
    assert str(info.value) == (
        f"model 'hf:{tmp_path}' needs the optional extra: pip install 'trainwise[hf]'"
    )


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "no config file at"),
        ("{not json", "cannot read"),
        ('{"n_layer": 2}', 'has no "model_type"'),
    ],
)
def test_hf_bad_config(tmp_path, content: str | None, needle: str) -> None:
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(ModelError, match=needle):
        build_hf(str(tmp_path))


def test_hf_real_model(tmp_path) -> None:
    pytest.importorskip("transformers")
    _write_gpt2_config(tmp_path, torch_dtype="bfloat16")
    bundle = build_model(ModelSpec(f"hf:{tmp_path / 'config.json'}", vocab_size=64))
    logits = bundle.module(torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, 64)
    assert logits.dtype == torch.float32  # the saved dtype does not leak into training
    assert bundle.module.vocab_size == 64
    assert len(bundle.blocks) == 2
    assert count_parameters(ModelSpec(f"hf:{tmp_path}")) > 0


# --- registry --------------------------------------------------------------------------------


def test_model_kind() -> None:
    assert model_kind("tiny") == "preset"
    assert model_kind("mlp") == "mlp"
    assert model_kind("hf:some/dir") == "hf"
    assert model_kind("pkg.mod:make") == "custom"


def test_unknown_name_lists_presets() -> None:
    with pytest.raises(ModelError) as info:
        build_model(ModelSpec("gtp2"))
    message = str(info.value)
    assert message.startswith("model.name = 'gtp2': not a preset (")
    for name in preset_names():
        assert name in message
    assert "'mlp'" in message and "package.module:factory" in message and "hf:" in message


def test_preset_names() -> None:
    assert preset_names()[:3] == ["tiny", "small", "gpt2-124m"]
    from trainwise.models.moe import MOE_PRESETS

    assert set(preset_names()) == set(PRESETS) | set(MOE_PRESETS)


def test_resolve_shape_applies_overrides() -> None:
    shape = resolve_shape(ModelSpec("gpt2-124m", vocab_size=256, seq_len=512))
    assert (shape.vocab_size, shape.max_seq_len, shape.n_layer) == (256, 512, 12)
    assert resolve_shape(ModelSpec("mlp")) is None
    with pytest.raises(ModelError, match="max_seq_len = 0"):
        resolve_shape(ModelSpec("tiny", seq_len=0))


def test_build_preset_bundle() -> None:
    bundle = build_model(ModelSpec("tiny", vocab_size=50, seq_len=32))
    assert isinstance(bundle.module, GPT)
    assert bundle.shape == resolve_shape(ModelSpec("tiny", vocab_size=50, seq_len=32))
    assert bundle.blocks == list(bundle.module.blocks) and len(bundle.blocks) == 2
    idx = torch.randint(0, 50, (2, 32))
    loss = bundle.loss_fn(bundle.module(idx), idx)
    assert loss.ndim == 0 and loss.item() > 0
    assert count_parameters(ModelSpec("tiny", vocab_size=50, seq_len=32)) == n_params(bundle.module)


def test_build_mlp_bundle() -> None:
    spec = ModelSpec("mlp", in_features=7, num_classes=4, hidden=(16,))
    bundle = build_model(spec)
    assert isinstance(bundle.module, MLPClassifier) and len(bundle.blocks) == 1
    out = bundle.module(torch.randn(5, 7))
    assert bundle.loss_fn(out, torch.tensor([0, 1, 2, 3, 0])).ndim == 0
    assert count_parameters(spec) == n_params(bundle.module) == 7 * 16 + 16 + 16 * 4 + 4


def test_mlp_needs_sizes() -> None:
    with pytest.raises(ModelError) as info:
        build_model(ModelSpec("mlp", in_features=3))
    assert info.value.problems == [
        "model.num_classes is required for model.name = 'mlp'; set it (the data usually decides it)"
    ]


def test_cross_entropy_loss_shapes() -> None:
    torch.manual_seed(0)
    lm_logits, lm_targets = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    expected = nn.functional.cross_entropy(lm_logits.transpose(1, 2), lm_targets)
    torch.testing.assert_close(cross_entropy_loss(lm_logits, lm_targets), expected)
    with pytest.raises(ModelError, match="does not match target shape"):
        cross_entropy_loss(torch.randn(4, 3), torch.zeros(4, 2, dtype=torch.long))


def test_hf_unknown_model_type(tmp_path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text('{"model_type": "no_such_arch_xyz"}')
    with pytest.raises(ModelError) as info:
        build_hf(str(tmp_path))
    message = str(info.value)
    assert "no_such_arch_xyz" in message and "\n" not in message and len(message) < 400
