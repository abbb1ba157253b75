"""Fine-tune a Hugging Face model end to end, on this machine, with nothing downloaded:

1. a tiny Llama-style model directory (random weights, saved by transformers) and a BPE
   tokenizer trained on the text beside this script (`tokenizers`);
2. `trainwise data prepare` of the question/answer pairs in qa.jsonl (prompt / response:
   only the answers are learned);
3. `trainwise train` from `hf:DIR` on 2 workers with FSDP (finetune.toml);
4. `trainwise export RUN --format hf`;
5. transformers' `from_pretrained` on the export: its logits against the trained
   checkpoint's, and a few generated tokens.

    python examples/finetune/run.py [--out runs/finetune-example] [--steps 40]

Everything is written under --out; the last line is JSON (what the test reads).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB = 384  # a multiple of 2, 4 and 8: tensor parallelism can split it


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/finetune-example", help="the folder to write")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--nproc", type=int, default=2, help="workers (FSDP)")
    args = parser.parse_args()
    out = Path(args.out)
    problem = fresh_folder(out)
    if problem:
        print(f"run.py: {problem}", file=sys.stderr)
        return 2

    model_dir = build_model_dir(out / "base-model")
    trainwise("data", "prepare", str(HERE / "qa.jsonl"), "--out", str(out / "qa"),
              "--tokenizer", f"hf:{model_dir}", "--field", "prompt",
              "--response-field", "response", "--quiet")
    trainwise("train", "--config", str(HERE / "finetune.toml"), "--nproc", str(args.nproc),
              "--steps", str(args.steps), "--run-dir", str(out / "run"),
              "--set", f"model.name='hf:{model_dir}'", "--set", f"data.path='{out / 'qa'}'")
    trainwise("export", str(out / "run"), "--format", "hf", "-o", str(out / "fine-tuned"))
    result = check_export(out, model_dir)
    print(f"transformers loads {out / 'fine-tuned'}: logits equal the trained checkpoint's "
          f"to {result['max_abs_diff']:.1e}; answer to {result['prompt']!r}: "
          f"{result['generated']!r}")
    print(json.dumps(result))
    return 0


MARK = ".finetune-example"  # what this script leaves in --out: a rerun may replace it


def fresh_folder(out: Path) -> str | None:
    """Empty `out` for this run; a folder this script did not write is never deleted
    (None, or why not)."""
    if out.exists() and any(out.iterdir()) and not (out / MARK).is_file():
        return (f"--out {out} exists and was not written by this example; "
                "give a new or empty folder")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / MARK).write_text("written by examples/finetune/run.py; a rerun replaces it\n")
    return None


def trainwise(*args: str) -> None:
    print("$ trainwise " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "trainwise", *args], check=True)


def build_model_dir(folder: Path) -> Path:
    """A 2-layer Llama (hidden 64, 4 heads, 2 key/value heads) with random weights and a
    BPE tokenizer trained on corpus.txt and qa.jsonl, as a model directory."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [(HERE / "corpus.txt").read_text(encoding="utf-8")]
    texts += [json.loads(line)["prompt"] + json.loads(line)["response"]
              for line in (HERE / "qa.jsonl").read_text(encoding="utf-8").splitlines()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
        tie_word_embeddings=True, eos_token_id=tok.token_to_id("<|endoftext|>"),
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    ))
    return folder


def check_export(out: Path, model_dir: Path) -> dict:
    """The export's logits (transformers) against the checkpoint's (trainwise's model), and
    a greedy answer to one question."""
    import torch
    import transformers

    from trainwise.export.weights import load_model_state, resolve_checkpoint
    from trainwise.models import ModelSpec, build_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "fine-tuned").eval()
    spec = ModelSpec(name=f"hf:{model_dir}", seq_len=64, impl="trainwise", init="random")
    trained = build_model(spec).module.eval()
    trained.load_state_dict(load_model_state(resolve_checkpoint(out / "run")), strict=True)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    prompt = "Question: Where is water carried from?\nAnswer:"
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits - trained(ids)).abs().max().item()
        generated = hf.generate(ids, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(generated[0, ids.shape[1]:].tolist())
    return {"max_abs_diff": diff, "prompt": prompt, "generated": answer,
            "export": str(out / "fine-tuned")}


if __name__ == "__main__":
    sys.exit(main())
