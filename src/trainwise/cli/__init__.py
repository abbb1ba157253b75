"""Argument parsing only: each subcommand module has add_parser() and run(args) -> int."""
