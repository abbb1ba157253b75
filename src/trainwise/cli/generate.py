"""`trainwise generate`: continue a prompt with a run's trained model (its newest valid
checkpoint, a LoRA run's adapters applied) or an exported Hugging Face directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainwise.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a prompt with a run's trained model or an exported model directory",
        description="Build the run's model as it trained (its converters too: a LoRA run "
        "has its adapters), load its newest valid checkpoint, tokenize the prompt with the "
        "tokenizer its prepared data was tokenized with, and print the continuation. An "
        "exported Hugging Face directory runs in transformers with its tokenizer.json. "
        "Greedy by default (deterministic); --top-p / --temperature sample, from --seed.",
    )
    # dest is not "run": the dispatcher calls args.run.
    p.add_argument("target", metavar="RUN|EXPORT_DIR", help="run directory or --format hf export")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=32, help="at most this many (32)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest valid one)")
    p.add_argument("--greedy", action="store_true", help="the most likely token (the default)")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of this mass")
    p.add_argument("--temperature", type=float, help="sampling temperature (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.set_defaults(run=run)


def sampling_of(args: argparse.Namespace):  # -> trainwise.export.generate.Sampling
    from trainwise.export.generate import Sampling

    sample = args.top_p is not None or args.temperature is not None
    if args.greedy and sample:
        raise ConfigError("--greedy takes no --top-p or --temperature: choose one way")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    how = Sampling(
        greedy=not sample,
        top_p=1.0 if args.top_p is None else args.top_p,
        temperature=1.0 if args.temperature is None else args.temperature,
        seed=args.seed,
    )
    if how.problems():
        raise ConfigError(how.problems())
    return how


def run(args: argparse.Namespace) -> int:
    if not args.prompt:
        raise ConfigError("--prompt is empty: give the text to continue, e.g. --prompt 'Question:'")
    how = sampling_of(args)
    # Imported here so that `trainwise --help` does not import torch.
    from trainwise.export.generate import generate_text
    from trainwise.export.trained import load_trained

    model = load_trained(Path(args.target), args.step)
    mode = "greedy" if how.greedy else f"top-p {how.top_p}, temperature {how.temperature}"
    print(f"trainwise: generating from {model.source} ({mode})", file=sys.stderr)
    print(generate_text(model, args.prompt, args.max_new_tokens, how))
    return 0
