"""What a checkpoint holds, as `Stateful` objects that DCP saves and loads by name.

The Checkpointer takes a mapping of them (as torchtitan's checkpointer takes its
`states`): the model and the optimizer (sharded as they live: DCP reshards on load) and
each rank's RNG states go through DCP; the trainer's progress (LR schedule, loss scaler)
is small and JSON, and goes into trainer.json. A new component of the state is one more
entry, not a new parameter.
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from trainwise.models.pipeline import stage_info

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
            k: plain(v)
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


def plain(value: Any) -> Any:
    """`value`, or the plain tensor a tensor subclass keeps its values in when it wraps one
    of its own shape and dtype (torchao's float8 weights under FSDP's float8 all-gather,
    and the optimizer's moments made like them): the same storage, so DCP saves plain
    tensors that any process reads (no pickled subclass, no torchao to load them) and loads
    into the parameter itself."""
    local = value._local_tensor if isinstance(value, DTensor) else value
    if not isinstance(local, torch.Tensor) or not hasattr(local, "__tensor_flatten__"):
        return value
    names, _ = local.__tensor_flatten__()
    inner = [getattr(local, n) for n in names]
    same = [t for t in inner if t.shape == local.shape and t.dtype == local.dtype]
    if len(same) != 1 or type(same[0]) is not torch.Tensor:
        return value
    if not isinstance(value, DTensor):
        return same[0]
    return DTensor.from_local(
        same[0], value.device_mesh, value.placements, run_check=False,
        shape=value.shape, stride=value.stride(),
    )


# DCP's flat optimizer format: one key per parameter and setting ("state.<fqn>.exp_avg",
# "param_groups.<fqn>.lr"), so that each rank writes and reads only the parameters of its
# parts (PyTorch's format for pipeline stages, as torchtitan's OptimizersContainer uses).
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizerState(Stateful):
    """The optimizer's state under the whole model's parameter names, so it reshards with
    the model and loads into any split of it. One optimizer over every part's parameters
    (run/engine/optim.py builds it so); DCP's state-dict API takes one module per call, so
    each part is saved and loaded through a view of the optimizer over that part's
    parameters (`_PartView`)."""

    def __init__(self, parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer):
        self.parts = parts
        self.optimizer = optimizer
        self.nested = False  # True while loading a checkpoint of the earlier format

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        options = self._options()
        for part in self.parts:
            view = _PartView(self.optimizer, part)
            state = get_optimizer_state_dict(part, view.optimizer, options=options)
            if self.nested:  # what the earlier format holds, to be read into it
                state = _one_group(state)
            out.update(_renamed({k: plain(v) for k, v in state.items()}, _copy_names(part)))
            view.write_back()  # a first save initialises the state: keep it
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        options = self._options()
        for part in self.parts:
            view = _PartView(self.optimizer, part)
            names = {whole: own for own, whole in _copy_names(part).items()}
            state = {**state_dict, **_renamed(state_dict, names)}
            if self.nested:  # its groups, by index, as this optimizer's
                current = get_optimizer_state_dict(part, view.optimizer, options=options)
                state = _regrouped(state, current["param_groups"])
            state = _with_job_step(self.optimizer, state)
            set_optimizer_state_dict(part, view.optimizer, state, options=options)
            view.write_back()
        _unshare(self.optimizer)

    def _options(self) -> StateDictOptions:
        """The flat format; the nested one (one list of groups naming every parameter,
        which no split of the model can share out) to read a checkpoint written before
        pipeline stages, into one part."""
        if not self.nested:
            return _FLAT
        if len(self.parts) > 1:
            raise ValueError(
                "its optimizer state has the format written before pipeline stages, which "
                "loads into one model part only; resume it without parallel.pp first"
            )
        return StateDictOptions()

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Each group's settings (lr, betas, decay): what a loaded state would replace."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def set_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        for group, settings in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(settings)


def written_nested(path: str | Path) -> bool:
    """Whether the checkpoint at `path` holds its optimizer state in the nested format
    trainwise wrote before pipeline stages (groups by index, each listing its parameters:
    "optim.param_groups.0.params"; the flat format keys them by parameter)."""
    try:
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 (unreadable: the load itself says why)
        return False
    return f"{OPTIMIZER}.param_groups.0.params" in keys


def _copy_names(part: torch.nn.Module) -> dict[str, str]:
    """{its name in `part`: the whole model's} of each copy a pipeline stage holds of a
    parameter under another name (a tied head on the last stage: models.pipeline): the
    whole model's optimizer state knows it by the first name only."""
    info = stage_info(part)
    ties = info.ties if info is not None else {}
    return {own: whole for own, whole in ties.items() if own != whole}


def _renamed(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """`state` (the flat optimizer format: "state.<name>.exp_avg", "param_groups.<name>.lr")
    with the entries of the parameters in `names` under their other name."""
    out = {}
    for key, value in state.items():
        kind, _, rest = key.partition(".")
        old = next((n for n in names if rest.startswith(n + ".")), None)
        out[f"{kind}.{names[old]}{rest[len(old):]}" if old else key] = value
    return out


# The group settings that say how the step runs (optim.implementation): the job's, not
# the checkpoint's. Set before torch places the loaded state (the fused step keeps its
# step counts on the parameters' device, the others on the host).
STEP_SETTINGS = ("fused", "foreach")


def _with_job_step(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """`state` (flat: "param_groups.<name>.fused"; or nested: a list of groups) with the
    step settings of `optimizer`, whose groups all run the same step."""
    job = {k: v for k, v in optimizer.param_groups[0].items() if k in STEP_SETTINGS}
    out = {}
    for key, value in state.items():
        setting = key.rpartition(".")[2]
        if key.startswith("param_groups.") and setting in job:
            value = job[setting]
        elif key == "param_groups" and isinstance(value, list):
            value = [{**group, **job} for group in value]
        out[key] = value
    return out


def _one_group(state: dict[str, Any]) -> dict[str, Any]:
    """The nested `state` with its groups as one (the first's settings, every parameter):
    the shape of the earlier format, which trainwise wrote with one group."""
    groups = state["param_groups"]
    merged = {**groups[0], "params": [name for g in groups for name in g["params"]]}
    return {**state, "param_groups": [merged]}


def _regrouped(state: dict[str, Any], groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The nested `state` with one group per group of `groups` (the optimizer's own, by
    parameter name), each with the settings of the saved group that held its first
    parameter: trainwise wrote one group before it made one a device mesh, and torch maps
    a saved group onto one current group only."""
    saved = state["param_groups"]
    regrouped = []
    for group in groups:
        source = next(g for g in saved if group["params"][0] in g["params"])
        regrouped.append({**source, "params": group["params"]})
    return {**state, "param_groups": regrouped}


def _unshare(optimizer: torch.optim.Optimizer) -> None:
    """Copies of one parameter on one rank (a tied embedding's, when the first and last
    stages share a rank, as in the V) load the same checkpoint entries, which the optimizer
    keeps as the same tensors: each gets its own, or one update would move both."""
    seen: set[int] = set()
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if id(value) in seen:
                    state[key] = value.clone()
                seen.add(id(value))


class _PartView:
    """The optimizer restricted to one part's parameters: an instance of the same class
    (DCP may step it once with lr 0 to create the state) holding the groups that have
    parameters in the part and their state. `write_back` puts what DCP set (state and
    group settings) into the real optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, part: torch.nn.Module):
        mine = {id(p) for p in part.parameters()}
        self.whole = optimizer
        self.groups: list[dict[str, Any]] = []  # the real groups the view's stand for
        view_groups = []
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if id(p) in mine]
            if params:  # DCP names a group by its first parameter: none, no group
                self.groups.append(group)
                view_groups.append({**group, "params": params})
        view = object.__new__(type(optimizer))
        # Its settings and hooks, not the methods bound to the real optimizer (the LR
        # scheduler wraps `step`): the view's step is its own, on its own groups.
        view.__dict__.update({k: v for k, v in vars(optimizer).items() if not callable(v)})
        view.param_groups = view_groups
        held = [p for g in view_groups for p in g["params"]]
        view.state = defaultdict(dict, {p: optimizer.state[p] for p in held if p in optimizer.state})
        self.optimizer = view

    def write_back(self) -> None:
        self.whole.state.update(self.optimizer.state)
        for group, loaded in zip(self.groups, self.optimizer.param_groups, strict=True):
            group.update({k: v for k, v in loaded.items() if k != "params"})


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
