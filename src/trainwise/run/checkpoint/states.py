"""What a checkpoint holds, as `Stateful` objects that DCP saves and loads by name.

The Checkpointer takes a mapping of them (as torchtitan's checkpointer takes its
`states`): the model and the optimizer (sharded as they live: DCP reshards on load) and
each rank's RNG states go through DCP; the trainer's progress (LR schedule, loss scaler)
is small and JSON, and goes into trainer.json. A new component of the state is one more
entry, not a new parameter.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

MODEL, OPTIMIZER, RNG = "model", "optim", "rng"


class ModelState(Stateful):
    """The weights of the model's parts in one mapping, as DCP's state-dict API names them
    whatever the wrapper (each part keeps the whole model's names, as torchtitan's
    ModelWrapper: the keys do not depend on how the model is split). Without
    `frozen_saved` (LoRA) only the trainable parameters: the frozen base is rebuilt from
    its source (pretrained files or seed, checked by the lineage) at every start."""

    def __init__(self, parts: list[torch.nn.Module], frozen_saved: bool = True):
        self.parts = parts
        self.options = StateDictOptions(ignore_frozen_params=not frozen_saved)

    def state_dict(self) -> dict[str, Any]:
        return {
            k: v
            for part in self.parts
            for k, v in get_model_state_dict(part, options=self.options).items()
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # One part must find all its keys; several each take theirs from the whole. Without
        # the frozen base, DCP's load has checked that every saved key was found.
        whole = len(self.parts) == 1 and not self.options.ignore_frozen_params
        options = StateDictOptions(strict=whole, ignore_frozen_params=self.options.ignore_frozen_params)
        for part in self.parts:
            set_model_state_dict(part, state_dict, options=options)


class OptimizerState(Stateful):
    """The optimizer's state, keyed by parameter names (so it reshards with the model).
    One optimizer over one part's parameters today; pipeline stages will bring one per
    part (torchtitan's OptimizersContainer)."""

    def __init__(self, parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer):
        if len(parts) != 1:
            raise ValueError(f"one optimizer state per model part: {len(parts)} parts")
        self.model = parts[0]
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Each group's settings (lr, betas, decay): what a loaded state would replace."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def set_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        for group, settings in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(settings)


def rng_key(rank: int) -> str:
    return f"rank-{rank:05d}"


def capture_rng(device: torch.device) -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


class RngState(Stateful):
    """This rank's random states under a key of its own, so that they travel with the
    shards and a failed write fails every rank together. Restored only at the same world
    size (another world has other ranks)."""

    def __init__(self, rank: int, device: torch.device):
        self.rank = rank
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        return {rng_key(self.rank): capture_rng(self.device)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore_rng(state_dict[rng_key(self.rank)], self.device)


def training_states(
    parts: list[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    rank: int,
    device: torch.device,
    frozen_saved: bool = True,
) -> dict[str, Stateful]:
    """The DCP part of a training checkpoint, over the model's parts (LoRA: without the
    frozen base, `frozen_saved` False)."""
    return {
        MODEL: ModelState(parts, frozen_saved),
        OPTIMIZER: OptimizerState(parts, optimizer),
        RNG: RngState(rank, device),
    }
