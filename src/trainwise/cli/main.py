"""The `trainwise` command: a tiny dispatcher over one module per subcommand. Typed errors
become messages and exit codes here and nowhere else."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from trainwise import __version__
from trainwise.cli import (
    checkpoints,
    data,
    doctor,
    env,
    export,
    generate,
    launch,
    plan,
    report,
    train,
)
from trainwise.errors import ConfigError, TrainwiseError
from trainwise.process_exit import exit_process

COMMANDS = (plan, train, doctor, report, env, checkpoints, export, generate, launch, data)


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors as one line naming --help, instead of the usage block first.
    Subcommands' parsers are of the same class (add_subparsers' default parser_class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
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
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand that was given them, not by `trainwise`
        words = ["trainwise", getattr(args, "command", None), getattr(args, "scheduler", None)]
        prog = " ".join(w for w in words if w)
        parser.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extra)}; "
                    f"see `{prog} --help`\n")
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


def command() -> NoReturn:
    """The `trainwise` command: main's status, as the process's exit status."""
    exit_process(main())


if __name__ == "__main__":
    command()
