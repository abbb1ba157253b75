"""The lineage of a run: the settings that decide what training computes, so that a
checkpoint resumes only into the run that wrote it.

A checkpoint records these keys (and the [moe] keys set to other than their defaults);
resume compares them with the job's. The layout may change between a save and a load (the
world size, the strategy, the micro-batch and the accumulation that keep the global batch:
DCP reshards), and so may `train.steps` (a higher count continues a finished run); what
the model is, how it is optimised, on which data in which order and at which precision
may not.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from trainwise.config.schema import JobConfig

# Whole sections that decide what training computes, less the keys that only say how a
# run starts (a resume does not start: model.init is moot once a checkpoint exists) and
# the kernels that compute the same values (to rounding) another way.
LINEAGE_SECTIONS = ("model", "optim", "schedule")
NOT_LINEAGE = ("model.init", "model.norm_impl", "optim.implementation")
# Keys that joined the lineage later: recorded only when set, so that the checkpoints of
# runs before them keep their lineage.
WHEN_SET = ("model.loss", "data.collate")
# Single keys of the other sections; the data's global batch is the job's (derived).
LINEAGE_KEYS = (
    "data.dataset", "data.path", "data.seq_len", "data.val_fraction", "data.vocab_size",
    "data.synthetic_tokens", "data.format", "data.packing", "train.seed", "train.grad_clip",
    "precision.dtype",
    "precision.reduce_dtype",
)


def lineage_keys(
    cfg: JobConfig, global_batch: int, base_weights: str | None = None
) -> dict[str, Any]:
    """The job's lineage as flat `section.key` -> value (JSON types). With LoRA, the
    [lora] keys and what the frozen base's weights come from (`base_weights`: it is
    rebuilt from there on resume, not saved); without, no lora keys at all, so that
    checkpoints of runs before LoRA keep their lineage. Float8 training computes other
    values than the same precision without it: precision.float8 when on (its all-gather
    only moves the same values: not lineage)."""
    dumped = cfg.model_dump(mode="json")
    keys: dict[str, Any] = {}
    for section in LINEAGE_SECTIONS:
        for key, value in dumped[section].items():
            if f"{section}.{key}" not in NOT_LINEAGE:
                keys[f"{section}.{key}"] = value
    for dotted in LINEAGE_KEYS + WHEN_SET:
        section, key = dotted.split(".")
        keys[dotted] = dumped[section][key]
    for dotted in WHEN_SET:
        if keys[dotted] is None:
            del keys[dotted]
    keys["data.global_batch"] = global_batch
    if cfg.lora.rank > 0:
        keys.update({f"lora.{k}": v for k, v in dumped["lora"].items()})
        keys["lora.base_weights"] = base_weights
    keys.update(moe_keys(cfg))
    if cfg.precision.float8 != "none":  # off: not recorded (the checkpoints before it)
        keys["precision.float8"] = cfg.precision.float8
    return keys


# [moe] keys only the planner reads: they change no training, so no resume checks them.
MOE_PLAN_ONLY = ("imbalance",)


def moe_keys(cfg: JobConfig) -> dict[str, Any]:
    """The [moe] keys that differ from their defaults: they change what a Mixture-of-
    Experts model trains to (its balancing), so a resume must keep them; left at their
    defaults they are not recorded, so that the checkpoints of dense models and of runs
    before [moe] keep their lineage."""
    default = type(cfg.moe)().model_dump(mode="json")
    return {
        f"moe.{k}": v for k, v in cfg.moe.model_dump(mode="json").items()
        if v != default[k] and k not in MOE_PLAN_ONLY
    }


def lineage_hash(keys: dict[str, Any]) -> str:
    """A short id of a lineage (16 hex chars of a sha256 over its sorted keys)."""
    text = json.dumps(keys, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def lineage_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """`key = THEIRS there, OURS here` for each key that differs, in key order."""
    out = []
    for key in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(key, "(unset)"), ours.get(key, "(unset)")
        if a != b:
            out.append(f"{key} = {json.dumps(a)} there, {json.dumps(b)} here")
    return out
