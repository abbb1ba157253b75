"""A LoRA run out of trainwise: `export --format peft` loaded by PEFT and `--format hf`
(the adapters merged) give the trained model's logits, `trainwise generate` decodes
greedily as transformers does, and the refusals are one line, exit 2. One training
launch (one process, a tiny Hugging Face Llama, LoRA rank 4) serves every check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import QUIET, SFT_SEQ, run_cli, sft_corpus, tiny_llama
from trainwise.cli.main import main

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.e2e

PROMPT = "Q7: what is what is what is 7 + 7?"
IDS = torch.tensor([list(PROMPT.encode())])  # the bytes tokenizer's ids


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 3-step LoRA fine-tune (the head trained fully too) of a pretrained tiny Llama on a
    byte-tokenized SFT corpus, exported both ways."""
    root = tmp_path_factory.mktemp("lora-out")
    base = tiny_llama(root / "base", vocab=257, positions=SFT_SEQ)
    corpus = sft_corpus(root)
    proc = run_cli(
        "train", *QUIET, "--nproc", "1", "--steps", "3", "--run-dir", "run",
        "--set", f"model.name=hf:{base}", "--set", "data.dataset=tokens",
        "--set", f"data.path={corpus}", "--set", "data.format=prompt_response",
        "--set", "data.seq_len=64", "--set", "data.micro_batch=2", "--set", "optim.lr=0.05",
        "--set", "lora.rank=4", "--set", "lora.alpha=8", "--set", "lora.train_head=true",
        "--set", "checkpoint.interval=3",
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = root / "run"
    for fmt in ("peft", "hf"):
        assert main(["export", str(run), "--format", fmt, "-o", str(root / fmt)]) == 0
    return {"root": root, "base": base, "run": run, "peft": root / "peft", "hf": root / "hf"}


def trained_logits(run: Path) -> torch.Tensor:
    from trainwise.export.trained import load_trained

    with torch.no_grad():
        return load_trained(run).logits(IDS)


def test_peft_loads_the_adapters_and_gives_the_trained_logits(lora: dict):
    import peft
    import transformers
    from safetensors.torch import load_file

    config = json.loads((lora["peft"] / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["modules_to_save"] == ["lm_head"]
    tensors = load_file(lora["peft"] / "adapter_model.safetensors")
    head = tensors.pop("base_model.model.lm_head.weight")  # trained fully: PEFT's plain name
    assert head.shape == (257, 32)
    assert len(tensors) == 2 * 2 * 7  # 2 layers x 7 Linears (q, k, v, o, gate, up, down) x A, B
    assert all(k.startswith("base_model.model.model.layers.") for k in tensors)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in tensors.items())
    base = transformers.AutoModelForCausalLM.from_pretrained(lora["base"]).eval()
    with torch.no_grad():
        before = base(input_ids=IDS).logits
        tuned = peft.PeftModel.from_pretrained(base, lora["peft"]).eval()
        after = tuned(input_ids=IDS).logits
    ours = trained_logits(lora["run"])
    assert (ours - before).abs().max() > 1e-3  # training moved the model: the check can fail
    assert (after - ours).abs().max() < 1e-5


def test_hf_export_merges_the_adapters_into_the_trained_model(lora: dict):
    import transformers
    from safetensors.torch import load_file

    names = load_file(lora["hf"] / "model.safetensors")
    assert not [k for k in names if "lora_" in k]
    merged = transformers.AutoModelForCausalLM.from_pretrained(lora["hf"]).eval()
    with torch.no_grad():
        theirs = merged(input_ids=IDS).logits
    assert (theirs - trained_logits(lora["run"])).abs().max() < 1e-5


def test_generate_greedy_is_transformers_greedy(lora: dict, capsys: pytest.CaptureFixture):
    import transformers

    from trainwise.export.generate import Sampling, continue_ids, decode
    from trainwise.export.trained import load_trained

    merged = transformers.AutoModelForCausalLM.from_pretrained(lora["hf"]).eval()
    with torch.no_grad():
        out = merged.generate(IDS, max_new_tokens=12, do_sample=False, eos_token_id=256,
                              pad_token_id=256, attention_mask=torch.ones_like(IDS))
    expected = out[0, IDS.shape[1]:].tolist()
    model = load_trained(lora["run"])
    assert continue_ids(model, IDS[0].tolist(), 12, Sampling()) == expected
    capsys.readouterr()
    assert main(["generate", str(lora["run"]), "--prompt", PROMPT, "--max-new-tokens", "12"]) == 0
    text = expected[:-1] if expected[-1] == 256 else expected
    assert capsys.readouterr().out == decode(model, text) + "\n"
    # Sampling is seeded, and a nucleus so small that it holds one token is greedy.
    narrow = Sampling(greedy=False, top_p=1e-6, seed=5)
    assert continue_ids(model, IDS[0].tolist(), 12, narrow) == expected
    wide = [continue_ids(model, IDS[0].tolist(), 12, Sampling(greedy=False, seed=s))
            for s in (1, 1, 2)]
    assert wide[0] == wide[1] and len(wide[2]) >= 1


def test_tied_embeddings_go_to_peft_under_both_names():
    """A tied head that trained: PEFT's ensure_weight_tying loads the embedding and the
    head from two equal tensors (safetensors holds no shared ones)."""
    from trainwise.config.schema import LoraConfig
    from trainwise.export.adapters import lora_config, peft_names, trained_whole
    from trainwise.models.llama import gpt_to_hf

    emb = torch.randn(11, 4)
    state = {"tok_emb.weight": emb, "blocks.0.attn.q_proj.lora_A.weight": torch.ones(2, 4),
             "blocks.0.attn.q_proj.lora_B.weight": torch.zeros(4, 2)}
    tensors, targets = peft_names(state, gpt_to_hf)
    assert targets == ["model.layers.0.self_attn.q_proj"]
    assert sorted(tensors) == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    lora = LoraConfig(rank=2, train_head=True)
    whole, full = trained_whole(state, gpt_to_hf, lora, tied=True)
    assert full == ["embed_tokens"]
    e, h = whole["base_model.model.model.embed_tokens.weight"], whole["base_model.model.lm_head.weight"]
    assert torch.equal(e, emb) and torch.equal(h, emb) and h.data_ptr() != e.data_ptr()
    assert lora_config(lora, targets, full, True, None).ensure_weight_tying
    assert trained_whole(state, gpt_to_hf, LoraConfig(rank=2), tied=True) == ({}, [])


def test_a_changed_base_is_refused(lora: dict, tmp_path: Path):
    """The checkpoint holds no base: one rebuilt from other weights is refused (the
    lineage's lora.base_weights), as a resume refuses it."""
    from safetensors.torch import load_file, save_file

    from trainwise.errors import ConfigError
    from trainwise.export.hf import checkpoint_model_spec
    from trainwise.export.trained import check_base, chosen_checkpoint

    checkpoint = chosen_checkpoint(lora["run"])
    spec = checkpoint_model_spec(checkpoint)
    check_base(checkpoint, spec, 0)  # the same base: nothing to say
    other = shutil.copytree(lora["base"], tmp_path / "other")
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    spec.name = f"hf:{other}"
    with pytest.raises(ConfigError, match="were trained on base weights xxh3:"):
        check_base(checkpoint, spec, 0)


def one_line_exit_2(args: list[str], capsys: pytest.CaptureFixture, words: str) -> None:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_refusals_are_one_line(lora: dict, tmp_path: Path, capsys: pytest.CaptureFixture):
    full = tmp_path / "full"  # the same run, as if it had trained every parameter
    shutil.copytree(lora["run"], full)
    config = full / "config.toml"
    config.write_text(config.read_text().replace("rank = 4", "rank = 0"))
    one_line_exit_2(["export", str(full), "--format", "peft", "-o", str(tmp_path / "p")],
                    capsys, "trained every parameter (lora.rank = 0)")
    run = str(lora["run"])
    one_line_exit_2(["generate", run, "--prompt", ""], capsys, "--prompt is empty")
    one_line_exit_2(["generate", run, "--prompt", "x", "--greedy", "--top-p", "0.9"],
                    capsys, "--greedy takes no --top-p")
    one_line_exit_2(["generate", run, "--prompt", "x", "--top-p", "1.5"], capsys, "--top-p 1.5")
    one_line_exit_2(["generate", str(lora["base"]), "--prompt", "x"], capsys, "no tokenizer.json")
    empty = tmp_path / "empty"
    shutil.copytree(lora["run"], empty, ignore=shutil.ignore_patterns("step-*"))
    one_line_exit_2(["generate", str(empty), "--prompt", "x"], capsys, "no checkpoints")
    synthetic = tmp_path / "synthetic"
    shutil.copytree(lora["run"], synthetic)
    config = synthetic / "config.toml"
    config.write_text(config.read_text().replace('dataset = "tokens"', 'dataset = "synthetic"'))
    one_line_exit_2(["generate", str(synthetic), "--prompt", "x"], capsys,
                    "data.dataset = 'synthetic', which has no tokenizer")
    moved = tmp_path / "moved"  # data.path relative to another folder than this one
    shutil.copytree(lora["run"], moved)
    config = moved / "config.toml"
    config.write_text(config.read_text().replace(str(lora["root"] / "sft"), "sft"))
    one_line_exit_2(["generate", str(moved), "--prompt", "x"], capsys, "is not found from here")
