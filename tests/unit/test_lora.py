"""LoRA on one process, in-process: the converter's targets and trainable count, the
bad-input refusals (one line each, before any worker), the model it trains (step 0 is the
base model, the frozen base does not move, only adapters reach the optimizer and the
checkpoint), the lineage that names the base weights, and the same losses as PEFT's LoRA
on a Hugging Face Llama from the same weights, data and adapters."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers import tiny_llama
from trainwise.config import load_config
from trainwise.config.lineage import lineage_differences, lineage_keys
from trainwise.config.schema import LoraConfig
from trainwise.errors import ConfigError
from trainwise.hardware import GB, DeviceInfo
from trainwise.models import ModelSpec, build_model
from trainwise.models.lora import (
    LoRAConverter,
    lora_layers,
    lora_line,
    merge_lora,
    parameter_counts,
    target_names,
)
from trainwise.run.checkpoint.states import training_states
from trainwise.run.engine.trainer import build_trainer
from trainwise.run.job.resolve import prepare_job

CPU = DeviceInfo("cpu", "cpu", 1, 64 * GB, bf16=True, fp16=False, gpu=None)
TINY = [
    "model.name='tiny'", "data.seq_len=16", "data.synthetic_tokens=4000",
    "parallel.strategy='single'", "data.micro_batch=2", "checkpoint.enabled=false",
]


def tiny_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelSpec(name="tiny", vocab_size=64, seq_len=16)).module


def trainer_for(*overrides: str):
    cfg = load_config(overrides=[*TINY, *overrides])
    job = prepare_job(cfg, 1, CPU)
    return build_trainer(cfg, job, torch.device("cpu")), job


def test_default_targets_are_attention_and_mlp_of_the_gpt_and_llama():
    gpt = tiny_gpt()
    n = len(gpt.blocks)
    names = {t.split(".", 2)[2] for t in target_names(gpt, None)}
    assert names == {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.up", "mlp.down"}
    assert len(target_names(gpt, None)) == 6 * n
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97,
    )
    with torch.device("meta"):
        llama = transformers.AutoModelForCausalLM.from_config(config)
    leaves = {t.rsplit(".", 1)[-1] for t in target_names(llama, None)}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert "lm_head" not in target_names(llama, None)


def test_the_converter_freezes_the_base_and_counts_the_adapters():
    gpt, rank = tiny_gpt(), 4
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        before = gpt(x)
    LoRAConverter(LoraConfig(rank=rank), "bf16").convert(gpt)
    layers = lora_layers(gpt)
    adapters = sum(rank * (m.in_features + m.out_features) for m in layers.values())
    trainable, total = parameter_counts(gpt)
    assert trainable == adapters and total > 10 * trainable
    assert f"{trainable:,} trainable of {total:,} parameters" in lora_line([gpt])
    assert all(isinstance(m, torch.nn.Linear) for m in layers.values())  # a subclass
    frozen = [p for p in gpt.parameters() if not p.requires_grad]
    assert {p.dtype for p in frozen} == {torch.bfloat16}  # the compute dtype
    assert {p.dtype for p in gpt.parameters() if p.requires_grad} == {torch.float32}
    q = gpt.blocks[0].attn.q_proj
    assert q.scaling == 16.0 / rank and q.lora_A.weight.shape == (rank, q.in_features)
    # B = 0: the base model's logits (under autocast, as a bf16 run computes them).
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.allclose(gpt(x).float(), before, atol=0.05)


def test_embeddings_and_head_train_when_asked():
    gpt = tiny_gpt()  # the tiny preset ties its head to the token embedding
    LoRAConverter(LoraConfig(rank=2, train_head=True), "fp32").convert(gpt)
    assert gpt.tok_emb.weight.requires_grad
    gpt = tiny_gpt()
    LoRAConverter(LoraConfig(rank=2, targets=["*.mlp.up"]), "fp32").convert(gpt)
    assert list(lora_layers(gpt)) == [f"blocks.{i}.mlp.up" for i in range(len(gpt.blocks))]
    assert not gpt.tok_emb.weight.requires_grad
    mlp = build_model(ModelSpec(name="mlp", in_features=8, num_classes=3, hidden=(16,))).module
    LoRAConverter(LoraConfig(rank=2, targets=["blocks.*"], train_head=True), "fp32").convert(mlp)
    assert list(lora_layers(mlp)) == ["blocks.0.0"] and mlp.head.weight.requires_grad


def test_merge_folds_the_update_into_the_base():
    gpt, cfg = tiny_gpt(), LoraConfig(rank=4, alpha=8.0)
    LoRAConverter(cfg, "fp32").convert(gpt)
    for layer in lora_layers(gpt).values():
        torch.nn.init.normal_(layer.lora_B.weight)  # a trained-looking update
    x = torch.randint(0, 64, (2, 16))
    merged = merge_lora(gpt.state_dict(), cfg)
    plain = tiny_gpt()
    plain.load_state_dict(merged)  # exactly the plain model's keys
    with torch.no_grad():
        torch.testing.assert_close(plain(x), gpt(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["lora.targets=['*.attn.q_proj', 'nothing_here']"], "'nothing_here' matches no nn.Linear"),
        (["lora.rank=4096"], "exceeds 'blocks.0.attn.q_proj''s smaller dimension"),
        (["model.name='mlp'", "data.dataset='digits'"], "none of the default patterns"),
    ],
)
def test_bad_lora_input_is_one_line_before_any_worker(overrides, says):
    cfg = load_config(overrides=[*TINY, "lora.rank=4", *overrides])
    with pytest.raises(ConfigError) as caught:
        prepare_job(cfg, 1, CPU)
    assert len(caught.value.problems) == 1, caught.value.problems
    assert says in caught.value.problems[0]
    assert caught.value.exit_status == 2


def test_an_empty_target_list_is_refused_where_the_config_is_read():
    # Unset means the defaults; an empty list would give adapters to nothing.
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=[*TINY, "lora.rank=4", "lora.targets=[]"])
    assert "lora.targets = []" in str(caught.value) and "is empty" in str(caught.value)
    assert caught.value.exit_status == 2


def test_training_moves_only_the_adapters_and_the_checkpoint_holds_only_them():
    trainer, job = trainer_for("lora.rank=4")
    model = trainer.parts[0]
    x = torch.randint(0, 64, (2, 16))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    opt_params = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in model.parameters() if p.requires_grad}
    losses = [float(trainer.train_step(iter([(x, x)])).loss) for _ in range(3)]
    assert losses[-1] < losses[0]
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name
    states = training_states(trainer.parts, trainer.optimizer, 0, torch.device("cpu"), frozen_saved=False)
    assert set(states["model"].state_dict()) == adapters
    # DCP's flat optimizer format: "state.<fqn>.<setting>" for each parameter with state.
    held = {k[len("state."):].rsplit(".", 1)[0] for k in states["optim"].state_dict()
            if k.startswith("state.")}
    assert held == adapters


def test_the_lineage_names_lora_and_the_base_weights(tmp_path: Path):
    plain = lineage_keys(load_config(overrides=TINY), 2)
    assert not any(k.startswith("lora.") for k in plain)  # earlier checkpoints still match
    folder = tiny_llama(tmp_path / "llama")
    cfg = load_config(overrides=[
        *TINY, f"model.name='hf:{folder}'", "data.vocab_size=97", "lora.rank=2",
    ])
    job = prepare_job(cfg, 1, CPU)
    assert job.base_weights.startswith("xxh3:")
    keys = lineage_keys(cfg, 2, job.base_weights)
    tiny_llama(tmp_path / "llama", seed=1)  # other base weights, same names and shapes
    changed = prepare_job(cfg, 1, CPU).base_weights
    assert changed != job.base_weights
    found = lineage_differences(keys, lineage_keys(cfg, 2, changed))
    assert [f.split(" =")[0] for f in found] == ["lora.base_weights"]


def test_trainwise_lora_trains_as_peft_lora(tmp_path: Path):
    """The same Llama weights, the same adapters' initial values, the same batches and
    AdamW: the same 20 losses (1e-5)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    folder = tiny_llama(tmp_path / "llama")
    rank, alpha, lr, steps = 4, 8.0, 1e-2, 20
    trainer, _ = trainer_for(
        f"model.name='hf:{folder}'", "data.vocab_size=97", f"lora.rank={rank}",
        f"lora.alpha={alpha}", f"optim.lr={lr}", "schedule.warmup_steps=0",
        "schedule.decay='constant'", "train.grad_clip=0",
    )
    ours = trainer.parts[0]
    theirs = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(folder),
        peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        ]),
    )
    ours_adapters = {
        n.removeprefix("model."): p for n, p in ours.named_parameters() if p.requires_grad
    }
    peft_adapters = {
        n.removeprefix("base_model.model.").replace(".default", ""): p
        for n, p in theirs.named_parameters() if p.requires_grad
    }
    assert ours_adapters.keys() == peft_adapters.keys()
    with torch.no_grad():
        for name, p in peft_adapters.items():
            p.copy_(ours_adapters[name])
    cfg = load_config(overrides=TINY)
    opt = torch.optim.AdamW(
        [p for p in theirs.parameters() if p.requires_grad], lr=lr, betas=cfg.optim.betas,
        eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay,
    )
    gen = torch.Generator().manual_seed(3)
    for step in range(steps):
        x = torch.randint(0, 97, (2, 16), generator=gen)
        y = torch.randint(0, 97, (2, 16), generator=gen)
        got = float(trainer.train_step(iter([(x, y)])).loss)
        loss = torch.nn.functional.cross_entropy(theirs(input_ids=x).logits.reshape(-1, 97), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert math.isclose(got, loss.item(), rel_tol=1e-5, abs_tol=1e-6), (step, got, loss)


def test_adapters_follow_their_base_split_under_tp():
    """On PyTorch's fake backend (no processes): colwise bases split lora_B by rows and keep
    lora_A whole, rowwise ones split lora_A by columns and keep lora_B whole; every frozen
    parameter stays frozen through the plan (SequenceParallel re-creates the norms)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainwise.models.converters import adapt_tp_plan
    from trainwise.run.engine.parallelize import apply_tp

    with torch.device("meta"):
        bundle = build_model(ModelSpec("small", vocab_size=256, seq_len=32))
    converter = LoRAConverter(LoraConfig(rank=4), "fp32")
    converter.convert(bundle.module)
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        apply_tp(bundle.module, mesh, adapt_tp_plan(bundle.module, bundle.tp_plan(True), [converter]))
    finally:
        torch.distributed.destroy_process_group()
    block = bundle.module.blocks[0]
    for layer, a, b, base in (
        (block.attn.q_proj, Replicate(), Shard(0), Shard(0)),
        (block.mlp.gate, Replicate(), Shard(0), Shard(0)),
        (block.attn.out_proj, Shard(1), Replicate(), Shard(1)),
        (block.mlp.down, Shard(1), Replicate(), Shard(1)),
    ):
        assert layer.lora_A.weight.placements == (a,) and layer.lora_B.weight.placements == (b,)
        assert layer.weight.placements == (base,) and not layer.weight.requires_grad
    trainable = {n for n, p in bundle.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not block.norm1.weight.requires_grad
