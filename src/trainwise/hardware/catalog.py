"""The hardware catalog: accelerators and the links between them, read from catalog.toml
(the data, each figure with its source, lives there and nowhere else). No torch here: the
planner reads the catalog in a process that never imports torch."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TFLOP = 1e12
GB = 1e9
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
SCOPES = ("intra", "inter")
# Architectures the planner has GEMM and attention efficiencies for (trainwise.plan.model.gemm).
GENERATIONS = ("volta", "turing", "ampere", "ada", "hopper", "blackwell", "cdna3", "cpu")


class CatalogError(ValueError):
    """A catalog file that does not hold what the code needs (one line, naming the key)."""


@dataclass(frozen=True)
class Link:
    """A link between GPUs: NVLink or PCIe within a node, a network between nodes."""

    name: str
    scope: str  # "intra" | "inter"
    bytes_per_s: float  # line rate per direction: per GPU (intra), per NIC (inter)
    source: str
    # The share of the line rate NCCL reaches (nccl-tests' bus bandwidth over it).
    efficiency: float = 1.0
    step_s: float = 0.0  # latency of one NCCL algorithm step over the link
    nics_per_node: int | None = None  # inter: NICs a node has (None: one per GPU)
    # NCCL channels a collective runs over the link: one thread block each, on an SM of
    # its own (NVIDIA/nccl issue #689); 0: not known, no contention modelled
    channels: int = 0

    @property
    def nccl_bytes_per_s(self) -> float:
        """What NCCL reaches on the link: the figure the planner's network model uses."""
        return self.bytes_per_s * self.efficiency


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: float  # 0 for "cpu": the machine's RAM, detected at run time
    peak_flops: dict[str, float]  # dense FLOP/s by precision; absent = not supported
    price_per_hour: float  # USD per GPU-hour, an assumption (see catalog.toml)
    source: str
    intra_node: Link | None = None
    aliases: tuple[str, ...] = field(default=())
    hbm_bytes_per_s: float = 0.0  # device memory bandwidth (datasheet)
    generation: str = "cpu"  # architecture: one of GENERATIONS

    def peak(self, precision: str) -> float | None:
        return self.peak_flops.get(precision)


@dataclass(frozen=True)
class Catalog:
    gpus: dict[str, GPUSpec]
    links: dict[str, Link]

    def gpu(self, name: str) -> GPUSpec | None:
        return find_gpu(name, self)

    def link(self, name: str) -> Link | None:
        return self.links.get(name)


def _number(value: Any, where: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CatalogError(f"{where} = {value!r} must be a number")
    if value < 0 or (positive and value == 0):
        raise CatalogError(f"{where} = {value!r} must be {'> 0' if positive else '>= 0'}")
    return float(value)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise CatalogError(f"{where} must be a non-empty string")
    return value


def parse_catalog(data: dict[str, Any], origin: str = "catalog.toml") -> Catalog:
    """Build and check a catalog from its TOML tables; every problem names its key."""
    links: dict[str, Link] = {}
    for name, table in data.get("link", {}).items():
        where = f"{origin}: link.{name}"
        scope = table.get("scope")
        if scope not in SCOPES:
            raise CatalogError(f"{where}.scope = {scope!r} must be one of {', '.join(SCOPES)}")
        efficiency = _number(table.get("efficiency", 1.0), f"{where}.efficiency")
        if efficiency > 1:
            raise CatalogError(f"{where}.efficiency = {efficiency} must be at most 1")
        nics = table.get("nics_per_node")
        links[name] = Link(
            name=name,
            scope=scope,
            bytes_per_s=_number(table.get("gbps"), f"{where}.gbps") * GB,
            source=_text(table.get("source"), f"{where}.source"),
            efficiency=efficiency,
            step_s=_number(table.get("step_us", 0.0), f"{where}.step_us", positive=False) * 1e-6,
            nics_per_node=None if nics is None else int(_number(nics, f"{where}.nics_per_node")),
            channels=int(_number(table.get("channels", 0), f"{where}.channels", positive=False)),
        )
    gpus: dict[str, GPUSpec] = {}
    for name, table in data.get("gpu", {}).items():
        where = f"{origin}: gpu.{name}"
        peaks = table.get("peak_tflops")
        if not isinstance(peaks, dict) or not peaks:
            raise CatalogError(f"{where}.peak_tflops must be a table of precision = TFLOP/s")
        unknown = sorted(set(peaks) - set(PRECISIONS))
        if unknown:
            raise CatalogError(
                f"{where}.peak_tflops has {unknown}; precisions are {', '.join(PRECISIONS)}"
            )
        link_name = table.get("intra_node")
        if link_name is not None and links.get(link_name) is None:
            raise CatalogError(f"{where}.intra_node = {link_name!r} is not a [link.*] table")
        if link_name is not None and links[link_name].scope != "intra":
            raise CatalogError(f"{where}.intra_node = {link_name!r} is not an intra-node link")
        generation = table.get("generation")
        if generation not in GENERATIONS:
            raise CatalogError(
                f"{where}.generation = {generation!r} must be one of {', '.join(GENERATIONS)}"
            )
        aliases = table.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise CatalogError(f"{where}.aliases must be a list of strings")
        gpus[name] = GPUSpec(
            name=name,
            memory_bytes=_number(table.get("memory_gb"), f"{where}.memory_gb", positive=False) * GB,
            peak_flops={
                p: _number(v, f"{where}.peak_tflops.{p}") * TFLOP for p, v in peaks.items()
            },
            price_per_hour=_number(
                table.get("price_per_hour"), f"{where}.price_per_hour", positive=False
            ),
            source=_text(table.get("source"), f"{where}.source"),
            intra_node=links[link_name] if link_name else None,
            aliases=tuple(aliases),
            hbm_bytes_per_s=_number(table.get("hbm_gbps"), f"{where}.hbm_gbps") * GB,
            generation=generation,
        )
    if not gpus:
        raise CatalogError(f"{origin}: no [gpu.*] table")
    return Catalog(gpus, links)


def load_catalog(path: Path | None = None) -> Catalog:
    """The catalog at `path`, or the one shipped with trainwise."""
    if path is None:
        return default_catalog()
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise CatalogError(f"{path}: cannot be read as TOML ({err})") from None
    return parse_catalog(data, str(path))


@cache
def default_catalog() -> Catalog:
    text = resources.files("trainwise.hardware").joinpath("catalog.toml").read_text("utf-8")
    return parse_catalog(tomllib.loads(text))


def _normal(name: str) -> str:
    text = name.upper()
    for noise in ("NVIDIA", "TESLA", "AMD", "INSTINCT"):
        text = text.replace(noise, " ")
    return " ".join(text.replace("_", " ").split())


def _tokens(name: str) -> set[str]:
    return set(_normal(name).replace("-", " ").split())


def find_gpu(name: str, catalog: Catalog | None = None) -> GPUSpec | None:
    """The catalog entry for a user-given name or a device name as CUDA reports it
    ('NVIDIA H100 80GB HBM3', 'NVIDIA A100-SXM4-40GB', 'Tesla T4'); None if unknown."""
    gpus = (catalog or default_catalog()).gpus
    wanted = _normal(name)
    for spec in gpus.values():
        if wanted in (_normal(n) for n in (spec.name, *spec.aliases)):
            return spec
    # A device name carries extra words: among the entries of its family (the first word
    # of the catalog name, e.g. H100), take the one sharing the most words with it; ties go
    # to the first listed (the SXM part, the usual one in training clusters).
    words = _tokens(name)
    best: tuple[int, GPUSpec] | None = None
    for spec in gpus.values():
        family = _normal(spec.name).split("-")[0]
        if family not in words:
            continue
        score = max(len(words & _tokens(n)) for n in (spec.name, *spec.aliases))
        if best is None or score > best[0]:
            best = (score, spec)
    return best[1] if best else None


def gpu_names(catalog: Catalog | None = None) -> list[str]:
    return list((catalog or default_catalog()).gpus)


def __getattr__(name: str) -> Any:
    # GPUS: the shipped catalog's GPUs by name (read on first use).
    if name == "GPUS":
        return default_catalog().gpus
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
