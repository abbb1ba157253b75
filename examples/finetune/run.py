"""Fine-tune a Hugging Face model end to end, on this machine, with nothing downloaded,
every parameter and with LoRA side by side:

1. a tiny Llama-style model directory (random weights, saved by transformers) and a BPE
   tokenizer trained on the text beside this script (`tokenizers`);
2. its pretraining, by trainwise: `trainwise data prepare corpus.txt`, `trainwise train`
   from `hf:DIR` on 1 worker, `trainwise export --format hf` -> base-model, the pretrained
   model both fine-tunes start from (LoRA adapts what a model already computes: on the
   random model's frozen weights it learns next to nothing);
3. `trainwise data prepare` of the question/answer pairs in qa.jsonl (prompt / response:
   only the answers are learned);
4. `trainwise train` from `hf:base-model` on 2 workers with FSDP (finetune.toml): once
   every parameter (run-full), once LoRA (run-lora: lora.rank = 8, the base frozen);
5. `trainwise export run-full --format hf` and `trainwise export run-lora --format peft`;
6. transformers' `from_pretrained` on the full export and PEFT's on the adapter: their
   logits against the trained checkpoints';
7. `trainwise generate` on both runs: their answers to one question, and both runs'
   first and last training losses and peak memory (metrics.jsonl's loss and mem_bytes).

    python examples/finetune/run.py [--out runs/finetune-example] [--steps 300]
        [--pretrain-steps 200] [--nproc 2]

Everything is written under --out; the last line is JSON (what the test reads).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
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
    parser.add_argument("--pretrain-steps", type=int, default=200,
                        help="optimizer steps of the base model's pretraining on corpus.txt")
    args = parser.parse_args()
    out = Path(args.out)
    problem = fresh_folder(out)
    if problem:
        print(f"run.py: {problem}", file=sys.stderr)
        return 2

    model_dir = pretrain(build_model_dir(out / "random-model"), out, args.pretrain_steps)
    trainwise("data", "prepare", str(HERE / "qa.jsonl"), "--out", str(out / "qa"),
              "--tokenizer", f"hf:{model_dir}", "--field", "prompt",
              "--response-field", "response", "--quiet")
    for run, extra in (("run-full", ()), ("run-lora", LORA)):
        trainwise("train", "--config", str(HERE / "finetune.toml"), "--nproc", str(args.nproc),
                  "--steps", str(args.steps), "--run-dir", str(out / run),
                  "--set", f"model.name='hf:{model_dir}'", "--set", f"data.path='{out / 'qa'}'",
                  *extra)
    trainwise("export", str(out / "run-full"), "--format", "hf", "-o", str(out / "fine-tuned"))
    trainwise("export", str(out / "run-lora"), "--format", "peft", "-o", str(out / "adapter"))
    result = check_exports(out, model_dir)
    print(f"transformers loads {out / 'fine-tuned'} and PEFT {out / 'adapter'}: logits equal "
          f"the trained checkpoints' to {result['max_abs_diff']:.1e} and "
          f"{result['peft_max_abs_diff']:.1e}")
    print(f"question: {PROMPT!r}")
    for run in ("full", "lora"):
        answer = generate(out / f"run-{run}")
        records = metrics(out / f"run-{run}")
        peak = max(records, key=lambda r: r.get("mem_bytes") or 0)
        result[run].update(answer=answer, first_loss=records[0]["loss"],
                           last_loss=records[-1]["loss"],
                           peak_mem_bytes=int(peak.get("mem_bytes") or 0),
                           mem_kind=str(peak.get("mem_kind")))
    for run in ("full", "lora"):
        r = result[run]
        print(f"  {run:4} fine-tune ({r['trainable']:,} of {r['parameters']:,} parameters "
              f"trained): loss {r['first_loss']:.2f} -> {r['last_loss']:.2f}, answers "
              f"{r['answer']!r}; peak memory {r['peak_mem_bytes'] / 1e6:.1f} MB "
              f"({r['mem_kind']})")
    print(json.dumps(result))
    return 0


PROMPT = "Question: Where is water carried from?\nAnswer:"
# The full fine-tune's lr (finetune.toml), with alpha / rank = 2; 3e-2 overshoots here.
LORA = ("--set", "lora.rank=8", "--set", "lora.alpha=16")


MARK = ".finetune-example"  # what this script leaves in --out: a rerun may replace it


def pretrain(random_dir: Path, out: Path, steps: int) -> Path:
    """The base model both fine-tunes start from: the random model trained by trainwise on
    corpus.txt (one process), exported as a Hugging Face directory with its tokenizer."""
    trainwise("data", "prepare", str(HERE / "corpus.txt"), "--out", str(out / "corpus"),
              "--tokenizer", f"hf:{random_dir}", "--quiet")
    trainwise("train", "--config", str(HERE / "finetune.toml"), "--nproc", "1",
              "--steps", str(steps), "--run-dir", str(out / "run-pretrain"),
              "--set", f"model.name='hf:{random_dir}'", "--set", f"data.path='{out / 'corpus'}'",
              *PRETRAIN)
    base = out / "base-model"  # export copies the tokenizer files beside the weights
    trainwise("export", str(out / "run-pretrain"), "--format", "hf", "-o", str(base))
    return base


# corpus.txt is one token stream (about 1,000 tokens): 8 windows of 64 a step, 10 % held out.
PRETRAIN = ("--set", "data.format='text'", "--set", "data.micro_batch=8",
            "--set", "data.val_fraction=0.1")


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
    """`trainwise ARGS` as typed; all but `train` (which launches workers) run the
    command's own code in this process: a Python start-up costs more than they do."""
    print("$ trainwise " + " ".join(map(shlex.quote, args)), flush=True)
    if args[0] == "train":
        subprocess.run([sys.executable, "-m", "trainwise", *args], check=True)
    else:
        in_process(list(args))


def in_process(args: list[str]) -> None:
    from trainwise.cli.main import main as trainwise_main

    status = trainwise_main(args)
    if status != 0:
        raise SystemExit(f"run.py: trainwise {args[0]} failed (exit status {status})")


def generate(run: Path) -> str:
    """`trainwise generate RUN` (greedy): the run's answer to PROMPT (its stdout)."""
    args = ["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "24"]
    print("$ trainwise " + " ".join(map(shlex.quote, args)), flush=True)
    answer = io.StringIO()
    with contextlib.redirect_stdout(answer):
        in_process(args)
    return answer.getvalue().removesuffix("\n")


def metrics(run: Path) -> list[dict]:
    """The run's metrics.jsonl: one record per optimizer step."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def build_model_dir(folder: Path) -> Path:
    """The model to pretrain: a 2-layer Llama (hidden 64, 4 heads, 2 key/value heads) with random weights and a
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


def check_exports(out: Path, model_dir: Path) -> dict:
    """The full export's logits (transformers) and the adapter's (PEFT on the base model)
    against their trained checkpoints' (trainwise's own model, as `generate` builds it)."""
    import peft
    import torch
    import transformers

    from trainwise.export.trained import load_trained
    from trainwise.models.lora import parameter_counts

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    transformers.utils.logging.disable_progress_bar()
    full, lora = load_trained(out / "run-full"), load_trained(out / "run-lora")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "fine-tuned").eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
        diff = (hf(input_ids=ids).logits - full.logits(ids)).abs().max().item()
        peft_diff = (adapted(input_ids=ids).logits - lora.logits(ids)).abs().max().item()
    counts = {}
    for name, trained in (("full", full), ("lora", lora)):
        trainable, total = parameter_counts(trained.module)
        counts[name] = {"trainable": trainable, "parameters": total}
    return {"max_abs_diff": diff, "peft_max_abs_diff": peft_diff, "prompt": PROMPT,
            "export": str(out / "fine-tuned"), "adapter": str(out / "adapter"), **counts}

if __name__ == "__main__":
    sys.exit(main())
