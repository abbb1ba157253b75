"""Typed errors of trainwise. Library code raises them; only the CLI turns them into
messages and exit codes (2 for bad input, before any worker starts)."""

from __future__ import annotations

from pathlib import Path


class TrainwiseError(Exception):
    """Base of every error trainwise raises on purpose."""

    exit_status = 1  # what the CLI exits with


class ConfigError(TrainwiseError):
    """Bad input: one or more problems, each a single line naming the key, the value
    and what is allowed."""

    exit_status = 2

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class ModelError(ConfigError):
    """A model name, import path or Hugging Face config that cannot be turned into a model."""


class DataError(ConfigError):
    """A dataset name or file that cannot be read as configured."""


def joined(before: list[str], err: ConfigError) -> ConfigError:
    """The problems found before `err` and its own, to raise at once: `err` itself when
    it has them all (a DataError stays one), else a ConfigError of them all."""
    return err if not before else ConfigError(before + err.problems)


class LaunchError(TrainwiseError):
    """A worker failed; the message names the rank, the exit code and the error.
    `run_dir` is the run it ended (set by the launcher), for a report of what it recorded;
    `report` that page, once written."""

    run_dir: Path | None = None
    report: Path | None = None
