"""A job's datasets and, when no formula knows its model, the model's profile
(models.profile): what the runtime's decision (run.job.resolve) and `trainwise plan` price
a model that is no preset with, read from the module at the job's settings and measured on
a micro-batch of the job's own data."""

from __future__ import annotations

from typing import Any

from trainwise.config import JobConfig
from trainwise.data import DataInfo, build_datasets, first_batch
from trainwise.models import ModelSpec
from trainwise.models.shapes import ModelProfile


def job_datasets(c: JobConfig) -> tuple[Any, Any, DataInfo]:
    """(train, val, info): the datasets of the job's [data] section."""
    return build_datasets(
        c.data.dataset,
        seq_len=c.data.seq_len,
        val_fraction=c.data.val_fraction,
        seed=c.train.seed,
        path=c.data.path,
        vocab_size=c.data.vocab_size,
        synthetic_tokens=c.data.synthetic_tokens,
        format=c.data.format,
        packing=c.data.packing,
        collate=c.data.collate,
        num_workers=c.data.num_workers,
    )


def job_spec(c: JobConfig, info: DataInfo | None = None) -> ModelSpec:
    """The model the job builds: its [model] section, with what the data decides (the
    vocabulary, a classifier's inputs and classes) when `info` is known."""
    return ModelSpec(
        name=c.model.name,
        vocab_size=c.model.vocab_size or (info.vocab_size if info else None),
        seq_len=c.data.seq_len,
        in_features=info.in_features if info else None,
        num_classes=info.num_classes if info else None,
        hidden=tuple(c.model.hidden),
        dropout=c.model.dropout,
        kwargs=dict(c.model.kwargs),
        init=c.model.init,
        impl=c.model.impl,
        loss=c.model.loss,
        norm_impl=c.model.norm_impl,
        aux_loss_coef=c.moe.aux_loss_coef,
        capacity_factor=c.moe.capacity_factor,
    )


def job_profile(
    c: JobConfig, spec: ModelSpec | None = None, train_set: Any = None
) -> ModelProfile:
    """The profile of the job's model (`spec`, default job_spec(c)) at its precision,
    checkpointing and micro-batch; a module that takes no token ids is measured on the
    first micro-batch of `train_set` (default: the job's, built when needed: a job whose
    data is not there yet is still planned, with its activations said to be uncounted)."""
    from trainwise.models.profile import profile_model

    micro = c.data.micro_batch

    def sample() -> Any:
        data = train_set if train_set is not None else job_datasets(c)[0]
        return first_batch(data, micro)

    return profile_model(
        spec or job_spec(c), sample=sample, precision=c.precision.dtype, ac=c.parallel.ac,
        micro_batch=micro,
    )
