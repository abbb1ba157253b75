"""A job as the library takes it: `JobSpec` (a config and layers of keys, each named as
its caller names it), the keyword tables of plan/train/doctor, and the one route of each
Python object (a model factory, a dataset, a collate or loss function) into a job key:
an import path, or the object by value (trainwise.objects)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from trainwise.errors import ConfigError, ModelError

if TYPE_CHECKING:
    from trainwise.config import JobConfig
    from trainwise.config.load import Layer


# The shortcuts of `trainwise plan`'s flags: keyword -> job key (the rest: sections or
# overrides). The CLI's flags of the same name set the same keys (a test holds it).
PLAN_KEYWORDS = {
    "model": "model.name",
    "data": "data.dataset",  # your own module is measured on a sample of it
    "collate": "data.collate",
    "params": "plan.params",
    "gpus": "plan.gpus",
    "gpu": "cluster.gpu",
    "gpus_per_node": "cluster.nproc",
    "strategy": "plan.strategy",
    "precision": "precision.dtype",
    "seq": "data.seq_len",
    "micro_batch": "data.micro_batch",
    "global_batch": "data.global_batch",
    "tokens": "plan.tokens",
    "objective": "plan.objective",
    "sweep": "plan.sweep",
}
# The shortcuts of `trainwise train` and `trainwise doctor`.
JOB_KEYWORDS = {
    "model": "model.name",
    "data": "data.dataset",
    "collate": "data.collate",
    "loss": "model.loss",
    "steps": "train.steps",
    "nproc": "cluster.nproc",
    "strategy": "parallel.strategy",
    "precision": "precision.dtype",
    "run_dir": "logging.run_dir",
    "oversubscribe": "cluster.oversubscribe",
    "only": "doctor.checks",
}
OVERRIDES = "overrides"  # where keys of `overrides` come from, in messages

JobSource = Union["JobConfig", str, Path, Mapping[str, Any], "JobSpec", None]


@dataclass(frozen=True)
class JobSpec:
    """A job as given, before it is checked: `config` (a TOML path, a dict of sections, a
    JobConfig, or None for the defaults) and `layers` of dotted keys over it, a later
    layer winning; each key carries the name its messages give it (a flag, `--set`, a
    keyword). `names` says how the caller names a verb's options (the CLI: its flags;
    default: the keyword, as `emit=`). The CLI builds one from its flags; a call with
    keywords adds its own layers to it."""

    config: JobConfig | str | Path | Mapping[str, Any] | None = None
    layers: tuple[Layer, ...] = ()
    names: Mapping[str, str] = field(default_factory=dict)

    def name(self, option: str) -> str:
        """How messages name the option `option` (a keyword of plan/train/doctor)."""
        return self.names.get(option, f"{option}=")

    def load(self, base: dict[str, Any] | None = None) -> tuple[JobConfig, dict[str, str]]:
        """The checked config, and where each key the user gave came from. `base`
        (dotted keys) replaces the schema's defaults when there is no config."""
        from trainwise.config.load import load_layers

        source = dict(self.config) if isinstance(self.config, Mapping) else self.config
        return load_layers(source, self.layers, base)


def job_spec(
    config: JobSource,
    shortcuts: Mapping[str, Any],
    table: Mapping[str, str],
    sections: Mapping[str, Any],
    overrides: Mapping[str, Any] | None,
) -> JobSpec:
    """`config` with the layers of a call's keywords on top: its section dicts and
    shortcuts (in one layer, shortcuts after sections), then `overrides`."""
    spec = config if isinstance(config, JobSpec) else JobSpec(config)
    layer: dict[str, tuple[Any, str]] = {}
    for name, value in sections.items():
        _section_keys(layer, name, value)
    for name, value in shortcuts.items():
        if isinstance(value, Mapping) and name in ("model", "data"):
            _section_keys(layer, name, value)  # model={...}: the section, not model.name
        elif value is not None:
            layer[table[name]] = (value, f"{name}=")
    over = {str(k): (v, OVERRIDES) for k, v in (overrides or {}).items()}
    return replace(spec, layers=(*spec.layers, layer, over))


def _section_keys(layer: dict[str, tuple[Any, str]], name: str, value: Any) -> None:
    from trainwise.config import JobConfig

    if name not in JobConfig.model_fields:
        raise ConfigError(
            f"unknown keyword {name}=: give a section of the job as a dict "
            f"({', '.join(JobConfig.model_fields)}), a shortcut, or overrides={{'key': value}}"
        )
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{name}={value!r}: a section is a dict of its keys, e.g. "
            f"{name}={{'key': value}} (or overrides={{'{name}.key': value}})"
        )
    for key, item in value.items():
        layer[f"{name}.{key}"] = (item, f"{name}=")


def model_key(model: Any) -> Any:
    """`model=` as the value of model.name: a preset, 'mlp', 'hf:DIR' or an import path as
    given (a dict is the [model] section); a factory or an nn.Module class as its import
    path, or by value (objects.object_reference). Every model object of the API enters
    the job here."""
    if model is None or isinstance(model, (str, Mapping)):
        return model
    if _is_module_instance(model):
        raise ModelError(
            f"model={type(model).__name__}(...): an nn.Module instance; give its class or a "
            "function that builds it (every worker builds its own, on the meta device)"
        )
    if not callable(model):
        raise ModelError(
            f"model={model!r}: give a preset name, 'hf:DIR', an import path, an nn.Module "
            "class or a function returning an nn.Module"
        )
    from trainwise.objects import object_reference

    return object_reference(model, "model", ModelError, "a model factory")


def data_key(data: Any) -> Any:
    """`data=` as the value of data.dataset: a built-in word or an import path as given (a
    dict is the [data] section); a Dataset, or a function returning one, as its import
    path or by value. Every dataset object of the API enters the job here."""
    if data is None or isinstance(data, (str, Mapping)):
        return data
    from trainwise.errors import DataError
    from trainwise.objects import object_reference

    return object_reference(data, "data", DataError, "a dataset or its factory")


def function_key(fn: Any, keyword: str) -> Any:
    """`collate=` / `loss=`: an import path as given, a function as its import path or by
    value."""
    if fn is None or isinstance(fn, str):
        return fn
    if not callable(fn):
        raise ConfigError(f"{keyword}={fn!r}: give a function or an import path 'module:fn'")
    from trainwise.objects import object_reference

    return object_reference(fn, keyword, ConfigError, "a function")


def by_value_names(objects: Mapping[str, Any], keys: Mapping[str, Any]) -> dict[str, str]:
    """How messages name the objects of a call that went by value: {"pickled:<digest>":
    "Net (by value)"} for each keyword whose job key (`keys`) is such a reference."""
    from trainwise.objects import is_pickled_reference

    names = {}
    for keyword, obj in objects.items():
        key = keys.get(keyword)
        if isinstance(key, str) and is_pickled_reference(key):
            name = getattr(obj, "__name__", None)
            names[key] = f"{name} (by value)" if name else f"a {type(obj).__name__} (by value)"
    return names


@contextmanager
def named_objects(names: Mapping[str, str]) -> Iterator[None]:
    """A ConfigError raised inside names the objects sent by value as the caller knows
    them (by_value_names), not by the digests of their references."""
    try:
        yield
    except ConfigError as err:
        if names:
            for reference, name in names.items():
                err.problems = [
                    p.replace(repr(reference), name).replace(reference, name)
                    for p in err.problems
                ]
            err.args = ("\n".join(err.problems),)
        raise


def _is_module_instance(obj: Any) -> bool:
    """An nn.Module instance, told without importing torch."""
    return not isinstance(obj, type) and any(
        c.__module__ == "torch.nn.modules.module" and c.__name__ == "Module"
        for c in type(obj).__mro__
    )


def import_roots(spec: JobSpec, cfg: JobConfig) -> None:
    """Let import paths find modules beside the job file, in the current directory, and
    where this process found the objects it names: here and in the workers (which
    inherit PYTHONPATH)."""
    from trainwise.objects import import_root, is_import_path

    roots = [os.getcwd()]
    if isinstance(spec.config, (str, Path)):
        roots.append(str(Path(spec.config).resolve().parent))
    for value in (cfg.model.name, cfg.data.dataset, cfg.data.collate, cfg.model.loss):
        root = import_root(value) if value and is_import_path(value) else None
        if root is not None:
            roots.append(str(root))
    for root in reversed(roots):
        if root not in sys.path:
            sys.path.insert(0, root)
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(roots + old))


