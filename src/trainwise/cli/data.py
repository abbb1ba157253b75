"""`trainwise data prepare`: tokenize text / JSONL files into a prepared token directory
that `data.path` trains from."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data",
        help="prepare training data (tokenize a corpus)",
        description="Work with training data.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare",
        help="tokenize text or JSONL files into token shards",
        description="Tokenize text files (one document each) or JSONL files (one document "
        "per line, its --field) into uint16/uint32 token shards with an EOS id after every "
        "document, plus index.json. Set data.dataset = 'tokens' and data.path = OUT to "
        "train on it.",
    )
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="text or .jsonl files")
    prep.add_argument("--out", required=True, help="the directory to create")
    prep.add_argument(
        "--tokenizer",
        required=True,
        help="a tokenizer.json, hf:MODEL_DIR (its tokenizer.json), or 'bytes' (UTF-8 bytes, "
        "EOS 256)",
    )
    prep.add_argument(
        "--field", default="text", help="the JSONL field holding the text (or the prompt)"
    )
    prep.add_argument(
        "--response-field",
        help="supervised fine-tuning: the JSONL field holding the response; --field is then "
        "the prompt, and only response tokens count in the loss",
    )
    prep.add_argument("--eos", help="the EOS token (default: from tokenizer_config.json)")
    prep.add_argument(
        "--shard-tokens",
        type=int,
        default=1 << 27,
        help="the most tokens in one shard file (default 134217728)",
    )
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
        command=_command(args),
    )
    print(
        f"trainwise: wrote {args.out}: {index['documents']} {_unit(index)}, {index['tokens']} tokens "
        f"({index['dtype']}, vocabulary {index['vocab_size']}, EOS {index['eos_id']}) in "
        f"{len(index['shards'])} shard(s)"
    )
    return 0


def _command(args: argparse.Namespace) -> list[str]:
    """The command that made the directory, as index.json records it."""
    line = ["trainwise", "data", "prepare", *args.inputs, "--out", args.out]
    line += ["--tokenizer", args.tokenizer, "--field", args.field]
    line += ["--response-field", args.response_field] if args.response_field else []
    line += ["--shard-tokens", str(args.shard_tokens)] + (["--eos", args.eos] if args.eos else [])
    return line


def _unit(index: dict) -> str:
    return "examples" if index.get("kind") == "prompt_response" else "documents"
