"""Loading a job: defaults < TOML file < command-line flags < ``--set key=value``.

Every problem is collected and raised once as a ConfigError, one line each, naming the
key, the value, where it came from and what is allowed.
"""

from __future__ import annotations

import copy
import hashlib
import re
import sys
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel, ValidationError

from trainwise.config.schema import JobConfig
from trainwise.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def load_config(
    path: str | Path | None = None,
    flags: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
    flag_names: dict[str, str] | None = None,
) -> JobConfig:
    """Build the job config. `flags` maps dotted keys to values (None = not given);
    `overrides` are ``key=value`` strings whose value is read as TOML (bare words are strings).
    `base` (dotted keys) replaces schema defaults when no file is given (`trainwise plan`'s
    own defaults); `flag_names` names the flag of a key in error messages."""
    return load_job(path, flags, overrides, base, flag_names)[0]


def load_job(
    path: str | Path | None = None,
    flags: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
    flag_names: dict[str, str] | None = None,
) -> tuple[JobConfig, dict[str, str]]:
    """load_config, and where each key the user gave came from (the file, a flag or
    --set; `base` and schema defaults are not given): what the planner keeps fixed."""
    names = flag_names or {}
    given = {
        key: (value, names.get(key) or "--" + key.rsplit(".", 1)[-1].replace("_", "-"))
        for key, value in (flags or {}).items()
    }
    return load_layers(path, [given, set_layer(overrides or [])], base)


def set_layer(items: list[str]) -> Layer:
    """`--set key=value` items as a layer (values read as TOML, bare words as strings);
    every malformed item is one line of the ConfigError."""
    problems: list[str] = []
    layer: Layer = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"--set {item!r}: expected key=value, e.g. --set optim.lr=3e-4")
            continue
        layer[key] = (parse_value(text.strip()), "--set")
    if problems:
        raise ConfigError(problems)
    return layer


# A layer of keys over a job: dotted key -> (value, where it came from, as messages name
# it: a flag, --set, a keyword of trainwise.train). A value of None is not given.
Layer = dict[str, tuple[Any, str]]
CONFIG_ORIGIN = "config"  # where the keys of a dict or a JobConfig given as the job came from


def load_layers(
    source: str | Path | dict[str, Any] | JobConfig | None = None,
    layers: list[Layer] | tuple[Layer, ...] = (),
    base: dict[str, Any] | None = None,
) -> tuple[JobConfig, dict[str, str]]:
    """The job from `source` with `layers` on top (a later layer wins), checked once:
    every problem raised together as one ConfigError. `source`: a TOML file, a dict of
    sections as such a file holds them, a JobConfig, or None (`base`'s dotted keys over
    the schema's defaults). Returns the config and where each key the user gave came from
    (`base` and schema defaults are not given)."""
    raw, origin = _source(source, base)
    for layer in layers:
        for key, (value, where) in layer.items():
            if value is not None:
                _assign(raw, key, value)
                origin[key] = where
    try:
        cfg = JobConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError([_describe(e, origin) for e in err.errors()]) from None
    problems = check_consistency(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg, {k: v for k, v in origin.items() if v != "defaults"}


def _source(
    source: str | Path | dict[str, Any] | JobConfig | None, base: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, str]]:
    """The raw sections of the job's source and the origin of each key it sets."""
    if source is None:
        raw: dict[str, Any] = {}
        for key, value in (base or {}).items():
            _assign(raw, key, value)
        return raw, dict.fromkeys(base or {}, "defaults")
    if isinstance(source, JobConfig):
        # Every value, so that the job is exactly this one; given: the keys it had set.
        given = source.model_dump(mode="json", by_alias=True, exclude_unset=True)
        raw = source.model_dump(mode="json", by_alias=True)
        return raw, dict.fromkeys(_leaf_keys(given), CONFIG_ORIGIN)
    if isinstance(source, dict):
        raw = copy.deepcopy(source)
        return raw, dict.fromkeys(_leaf_keys(raw), CONFIG_ORIGIN)
    raw = read_toml(Path(source))
    return raw, dict.fromkeys(_leaf_keys(raw), str(source))


def read_toml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(
            f"config file {path} is a directory: --config takes a TOML job file "
            f"(e.g. {path / 'job.toml'})"
        )
    if not path.is_file():
        raise ConfigError(f"config file {path} not found: check the --config path")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"config file {path} cannot be read ({err}): give a UTF-8 TOML file"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        # The decoder's message ends with "(at line L, column C)"; lead with the location.
        msg = str(err)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        where = f"{path}:{m.group(1)}:{m.group(2)}" if m else str(path)
        reason = re.sub(r"\s*\(at line \d+, column \d+\)", "", msg) if m else msg
        raise ConfigError(f"{where}: TOML syntax error: {reason}; fix the file") from None


def parse_value(text: str) -> Any:
    """A --set value as TOML (numbers, booleans, lists, quoted strings); anything else is a
    plain string, so `--set model.name=tiny` works without quotes."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def check_consistency(cfg: JobConfig) -> list[str]:
    """Combinations that are wrong whatever the machine; each line names the keys and the fix."""
    problems = []
    name = cfg.model.name
    custom = ":" in name and not name.startswith("hf:")
    if cfg.data.dataset == "tokens" and not cfg.data.path:
        problems.append("data.path is not set but data.dataset = 'tokens': set the token file")
    if name == "mlp" and cfg.data.dataset != "digits":
        problems.append(
            f"model.name = 'mlp' is a classifier but data.dataset = '{cfg.data.dataset}': "
            "use data.dataset = 'digits'"
        )
    if cfg.data.dataset == "digits" and name != "mlp" and not custom:
        problems.append(
            f"data.dataset = 'digits' is for classifiers but model.name = '{name}': "
            "use 'mlp' or your own 'module:factory'"
        )
    if cfg.parallel.cpu_offload and cfg.parallel.strategy == "auto":
        problems.append(
            "parallel.cpu_offload = true with parallel.strategy = 'auto': auto decides offload "
            "from the memory estimate; set parallel.strategy = 'fsdp' to force it"
        )
    elif cfg.parallel.cpu_offload and cfg.parallel.strategy not in ("fsdp", "hsdp"):
        problems.append(
            f"parallel.cpu_offload = true needs sharding; parallel.strategy = "
            f"'{cfg.parallel.strategy}': use 'fsdp' or 'hsdp'"
        )
    if cfg.parallel.replicate is not None and cfg.parallel.strategy != "hsdp":
        problems.append(
            f"parallel.replicate = {cfg.parallel.replicate} applies to hsdp only; "
            f"parallel.strategy = '{cfg.parallel.strategy}': remove it or use 'hsdp'"
        )
    if cfg.train.nonfinite == "rollback" and not cfg.checkpoint.enabled:
        problems.append(
            "train.nonfinite = 'rollback' reloads the last checkpoint, but checkpoint.enabled = "
            "false: enable checkpoints or choose 'skip' or 'stop'"
        )
    window = cfg.logging.profile_steps
    if window and window[1] > cfg.train.steps:
        problems.append(
            f"logging.profile_steps = {window} ends after the run's last step (train.steps = "
            f"{cfg.train.steps}): trace steps up to {cfg.train.steps}"
        )
    return problems


# What may differ between the machines of one job: each names its own place.
PER_MACHINE = ("node_rank", "local_addr", "socket_ifname")


def job_hash(cfg: JobConfig) -> str:
    """A short id of the job's config (16 hex chars of a sha256), the same on every machine
    of the job: the settings of PER_MACHINE are left out."""
    cluster = cfg.cluster.model_copy(update=dict.fromkeys(PER_MACHINE))
    text = dump_toml(cfg.model_copy(update={"cluster": cluster}))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def config_from_toml(text: str) -> JobConfig:
    """The config `dump_toml` wrote, read back (what a launcher hands its workers)."""
    return JobConfig.model_validate(tomllib.loads(text))


def dump_toml(cfg: JobConfig) -> str:
    """The resolved config as commented TOML that `load_config` reads back to the same value."""
    out = ["# trainwise job: defaults < file < flags < --set, resolved\n"]
    for section_name, section in cfg:
        out.append(f"\n[{section_name}]\n")
        for key, field in type(section).model_fields.items():
            value = getattr(section, key)
            name = field.alias or key  # e.g. checkpoint.async (a Python keyword)
            if field.description:
                out.append(f"# {field.description}\n")
            if value is None:
                out.append(f"# {name} = (unset)\n")
            else:
                out.append(f"{name} = {toml_value(value)}\n")
    return "".join(out)


def toml_value(value: Any) -> str:
    """One value as inline TOML (tables and arrays on one line, readable in a config dump)."""
    if isinstance(value, dict):
        inner = ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items())
        return "{ " + inner + " }" if inner else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return tomli_w.dumps({"v": value})[len("v = ") :].strip()


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else tomli_w.dumps({key: 0}).split(" = ")[0]


def _assign(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _leaf_keys(raw: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for k, v in raw.items():
        if isinstance(v, dict) and k != "kwargs":
            keys += _leaf_keys(v, f"{prefix}{k}.")
        else:
            keys.append(prefix + k)
    return keys


def _describe(error: dict, origin: dict[str, str]) -> str:
    """One line for one pydantic error: key, value, source, what is allowed."""
    loc = [str(p) for p in error["loc"] if not isinstance(p, int)]
    key = ".".join(loc)
    src = origin.get(key) or next(
        (s for k, s in origin.items() if k.startswith(key + ".")), "defaults"
    )
    if error["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        where = f"[{'.'.join(loc[:-1])}]" if len(loc) > 1 else "the top level"
        return f"unknown key '{key}' (from {src}); keys allowed in {where}: {allowed}"
    value = error.get("input")
    msg = error["msg"]
    if error["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")
    return f"{key} = {value!r} (from {src}): {msg}"


def _allowed_keys(loc: list[str]) -> str:
    model: type[BaseModel] = JobConfig
    for part in loc:
        field = model.model_fields.get(part)
        if field is None or not isinstance(field.annotation, type):
            return "see `trainwise train --print-config`"
        model = field.annotation  # type: ignore[assignment]
    return ", ".join(f.alias or name for name, f in model.model_fields.items())
