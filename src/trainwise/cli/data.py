"""`trainwise data prepare`: tokenize text / JSONL files into a prepared token directory
that `data.path` trains from."""

from __future__ import annotations

import argparse
import os
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data",
        help="prepare training data (tokenize a corpus)",
        description="Work with training data.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare",
        help="tokenize text, JSONL, Parquet or a saved dataset into token shards",
        description="Tokenize text files (one document each), JSONL or Parquet files and "
        "Hugging Face datasets saved with save_to_disk (one document per record: its --field "
        "or --column) into uint16/uint32 token shards with an EOS id after every document, "
        "plus index.json. Run again after a kill, it resumes. Set data.dataset = 'tokens' "
        "and data.path = OUT to train on it.",
    )
    prep.add_argument(
        "inputs", nargs="+", metavar="INPUT",
        help="text, .jsonl or .parquet files, or folders written by datasets' save_to_disk",
    )
    prep.add_argument("--out", required=True, help="the directory to create")
    prep.add_argument(
        "--tokenizer",
        required=True,
        help="a tokenizer.json, hf:MODEL_DIR (its tokenizer.json), or 'bytes' (UTF-8 bytes, "
        "EOS 256)",
    )
    prep.add_argument(
        "--field", "--column", dest="field", default="text",
        help="the field (JSONL) or column (Parquet, dataset) holding the text, or the prompt",
    )
    prep.add_argument(
        "--response-field",
        help="supervised fine-tuning: the JSONL field holding the response; --field is then "
        "the prompt, and only response tokens count in the loss",
    )
    prep.add_argument(
        "--messages-field",
        help="supervised fine-tuning on conversations: the field holding a list of "
        "{role, content} messages, rendered with the tokenizer's chat template; only the "
        "assistant's turns count in the loss",
    )
    prep.add_argument(
        "--eos",
        help="the EOS: id:N (an id), token:TEXT or TEXT (a token); a bare number is refused "
        "as ambiguous (default: tokenizer_config.json's eos_token)",
    )
    prep.add_argument(
        "--errors", choices=("strict", "replace", "ignore"), default="strict",
        help="bytes that are not UTF-8: strict (stop, naming the file and byte; default), "
        "replace (with U+FFFD) or ignore (drop them)",
    )
    prep.add_argument(
        "--shard-tokens",
        type=int,
        default=1 << 27,
        help="the most tokens in one shard file (default 134217728)",
    )
    prep.add_argument(
        "--val-fraction", type=float, default=0.0,
        help="hold out this share of whole documents in OUT/val (the held-out split "
        "training evaluates on); default 0: training cuts its own",
    )
    prep.add_argument(
        "--workers", type=int, default=min(os.cpu_count() or 1, 8),
        help="tokenizer processes (default: the cores, at most 8)",
    )
    prep.add_argument("--quiet", action="store_true", help="no progress line")
    prep.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from trainwise.data.prepare import load_tokenizer, prepare

    tokenizer = load_tokenizer(args.tokenizer, args.eos)
    index = prepare(
        args.inputs,
        args.out,
        tokenizer,
        field=args.field,
        response_field=args.response_field,
        shard_tokens=args.shard_tokens,
        val_fraction=args.val_fraction,
        messages_field=args.messages_field,
        errors=args.errors,
        workers=args.workers,
        command=_command(args),
        say=lambda line: print(line, file=sys.stderr),
        progress=not args.quiet,
    )
    print(
        f"trainwise: wrote {args.out}: {index['documents']} {_unit(index)}, {index['tokens']} tokens "
        f"({index['dtype']}, vocabulary {index['vocab_size']}, EOS {index['eos_id']}) in "
        f"{len(index['shards'])} shard(s)"
    )
    if "val" in index:
        print(f"trainwise: held out {index['val']['documents']} {_unit(index)} in "
              f"{args.out}/val ({index['val']['tokens']} tokens)")
    return 0


def _command(args: argparse.Namespace) -> list[str]:
    """The command that made the directory, as index.json records it."""
    line = ["trainwise", "data", "prepare", *args.inputs, "--out", args.out]
    line += ["--tokenizer", args.tokenizer, "--field", args.field]
    line += ["--response-field", args.response_field] if args.response_field else []
    line += ["--shard-tokens", str(args.shard_tokens)] + (["--eos", args.eos] if args.eos else [])
    line += ["--val-fraction", str(args.val_fraction)] if args.val_fraction else []
    line += ["--messages-field", args.messages_field] if args.messages_field else []
    line += ["--errors", args.errors] if args.errors != "strict" else []
    return line


def _unit(index: dict) -> str:
    return "examples" if index.get("kind") == "prompt_response" else "documents"
