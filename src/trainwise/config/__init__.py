"""The schema of a job, loaded once at the edge with clear errors."""

from trainwise.config.load import (
    check_consistency,
    config_from_toml,
    dump_toml,
    job_hash,
    load_config,
    parse_value,
    read_toml,
)
from trainwise.config.schema import JobConfig, Precision, Strategy

__all__ = [
    "JobConfig",
    "Precision",
    "Strategy",
    "check_consistency",
    "config_from_toml",
    "dump_toml",
    "job_hash",
    "load_config",
    "parse_value",
    "read_toml",
]
