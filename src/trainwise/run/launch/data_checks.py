"""The checks of a job's data against its model, made once by the launcher before any
worker starts (a worker that met these would crash, and be restarted, on every rank):
the prepared shards hold what `data prepare` wrote (checksums, ids inside the vocabulary),
they were tokenized by the model's own tokenizer, and the sequence fits the model's
positions."""

from __future__ import annotations

from trainwise.config import JobConfig
from trainwise.data import is_prepared_dir, read_index
from trainwise.data.shards import verify_shards
from trainwise.data.sources import source_sha256
from trainwise.errors import ConfigError


def check_data(cfg: JobConfig) -> None:
    """Every problem of the data against the model, raised once (ConfigError, exit 2)."""
    problems = [*position_problems(cfg), *tokenizer_problems(cfg)]
    if problems:
        raise ConfigError(problems)
    path = cfg.data.path
    if cfg.data.dataset == "tokens" and path and is_prepared_dir(path) and cfg.data.verify == "full":
        verify_shards(path)


def _hf_path(cfg: JobConfig) -> str | None:
    name = cfg.model.name
    return name[3:] if name.startswith("hf:") else None


def position_problems(cfg: JobConfig) -> list[str]:
    """data.seq_len within a Hugging Face model's max_position_embeddings."""
    path = _hf_path(cfg)
    if path is None:
        return []
    from trainwise.models.hf import read_hf_config

    most = read_hf_config(path).get("max_position_embeddings")
    if not isinstance(most, int) or cfg.data.seq_len <= most:
        return []
    return [
        f"data.seq_len = {cfg.data.seq_len} is longer than the {most} positions of "
        f"model.name = 'hf:{path}' (max_position_embeddings in its config.json): lower "
        "data.seq_len, or raise max_position_embeddings if the model is meant to take more"
    ]


def tokenizer_problems(cfg: JobConfig) -> list[str]:
    """A prepared corpus tokenized by the tokenizer of model.name = 'hf:DIR' (when DIR
    has a tokenizer.json to compare with)."""
    path, data = _hf_path(cfg), cfg.data.path
    if path is None or cfg.data.dataset != "tokens" or not data or not is_prepared_dir(data):
        return []
    from trainwise.models.hf import model_dir

    theirs = model_dir(path) / "tokenizer.json"
    used = read_index(data).get("tokenizer") or {}
    if not theirs.is_file() or not used.get("sha256"):
        return []
    if used["sha256"] == source_sha256(theirs):
        return []
    return [
        f"data.path = '{data}' was tokenized with {used.get('spec')!r}, not with the "
        f"tokenizer of model.name = 'hf:{path}' ({theirs} differs): prepare it again with "
        f"`trainwise data prepare ... --tokenizer hf:{path}`"
    ]


__all__ = ["check_data"]
