"""The `trainwise` command: a tiny dispatcher over one module per subcommand. Typed errors
become messages and exit codes here and nowhere else."""

from __future__ import annotations

import argparse
import sys

from trainwise import __version__
from trainwise.cli import checkpoints, data, doctor, env, export, launch, plan, report, train
from trainwise.errors import ConfigError, TrainwiseError

COMMANDS = (plan, train, doctor, report, env, checkpoints, export, launch, data)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainwise",
        description="Plan, train, check and report distributed PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"trainwise {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except ConfigError as err:
        for problem in err.problems:
            print(f"trainwise: error: {problem}", file=sys.stderr)
        return 2
    except TrainwiseError as err:
        print(f"trainwise: {err}", file=sys.stderr)
        return err.exit_status
    except KeyboardInterrupt:
        print("trainwise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
