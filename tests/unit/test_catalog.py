"""The hardware catalog (catalog.toml): what it holds, how device names find their entry,
and how a malformed catalog is refused with the key at fault."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainwise.config import load_config
from trainwise.errors import ConfigError
from trainwise.hardware import (
    GB,
    TFLOP,
    CatalogError,
    default_catalog,
    find_gpu,
    load_catalog,
)
from trainwise.hardware.catalog import GENERATIONS, parse_catalog

# The GPUs the planner must know (issue: plan), by the names users type.
REQUIRED = ["V100", "T4", "L4", "A10G", "A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe",
            "H200", "B200", "MI300X", "cpu"]


def test_every_required_gpu_is_there_with_sources_and_a_link():
    gpus = default_catalog().gpus
    assert set(REQUIRED) <= set(gpus)
    for spec in gpus.values():
        assert spec.source.strip(), spec.name
        assert spec.intra_node is not None and spec.intra_node.scope == "intra", spec.name
        assert spec.intra_node.source.strip()
        assert spec.memory_bytes > 0 or spec.name == "cpu"
        assert spec.peak("fp32") is not None, spec.name  # every device runs fp32


def test_lower_precisions_are_never_slower():
    for spec in default_catalog().gpus.values():
        p = spec.peak_flops
        for low, high in (("bf16", "fp32"), ("fp16", "fp32"), ("fp8", "bf16")):
            if low in p and high in p:
                assert p[low] >= p[high], (spec.name, low)


def test_published_figures_dense():
    """Datasheets print sparse rates; the catalog holds half of them (dense)."""
    gpus = default_catalog().gpus
    assert gpus["H100-SXM"].peak("bf16") == 1979 / 2 * TFLOP  # H100 SXM5: 1,979 TFLOPS sparse
    assert gpus["A100-80GB"].peak("bf16") == 312 * TFLOP  # A100: 312 dense (624 sparse)
    assert gpus["A100-80GB"].peak("fp32") == 156 * TFLOP  # TF32 tensor cores
    # Memory as CUDA reports it: the datasheets' binary "141 GB" (143,156 MiB to torch),
    # not 141e9 bytes.
    assert gpus["H200"].memory_bytes == pytest.approx(143156 * 2**20, rel=1e-4)
    assert gpus["H100-SXM"].memory_bytes > 80 * 2**30 * 0.98  # "80GB": 80 GiB, less the driver's
    assert gpus["V100"].peak("bf16") is None and gpus["T4"].peak("bf16") is None
    nvlink4 = gpus["H100-SXM"].intra_node
    assert nvlink4.bytes_per_s == 900 / 2 * GB  # 900 GB/s both directions together


@pytest.mark.parametrize(
    ("device", "entry"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("Tesla V100-SXM2-32GB", "V100"),
        ("Tesla T4", "T4"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA B200", "B200"),
        ("AMD Instinct MI300X", "MI300X"),
        ("h100", "H100-SXM"),
        ("cpu", "cpu"),
    ],
)
def test_device_names_find_their_entry(device: str, entry: str):
    assert find_gpu(device).name == entry


@pytest.mark.parametrize("device", ["NVIDIA A10", "NVIDIA GeForce RTX 4090", "TPU v5e", ""])
def test_unknown_devices_are_none(device: str):
    assert find_gpu(device) is None


GOOD = {
    "link": {"nv": {"scope": "intra", "gbps": 100, "source": "s"}},
    "gpu": {
        "X1": {
            "memory_gb": 10,
            "peak_tflops": {"fp32": 1},
            "hbm_gbps": 1000,
            "generation": "hopper",
            "intra_node": "nv",
            "price_per_hour": 1,
            "source": "s",
        }
    },
}


def broken(path: str, value: object) -> dict:
    """GOOD with one key replaced (value None: removed)."""
    import copy

    data = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    table = data
    for key in parents:
        table = table[key]
    if value is None:
        del table[last]
    else:
        table[last] = value
    return data


def test_a_good_catalog_parses():
    catalog = parse_catalog(GOOD)
    assert catalog.gpus["X1"].intra_node.bytes_per_s == 100 * GB


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("gpu.X1.source", None, "gpu.X1.source must be a non-empty string"),
        ("gpu.X1.memory_gb", -1, "gpu.X1.memory_gb = -1 must be >= 0"),
        ("gpu.X1.peak_tflops", {"fp4": 1}, "precisions are fp32, bf16, fp16, fp8"),
        ("gpu.X1.peak_tflops", {"fp32": 0}, "gpu.X1.peak_tflops.fp32 = 0 must be > 0"),
        ("gpu.X1.intra_node", "warp", "'warp' is not a [link.*] table"),
        ("link.nv.scope", "galactic", "link.nv.scope = 'galactic' must be one of intra, inter"),
        ("link.nv.gbps", "fast", "link.nv.gbps = 'fast' must be a number"),
        ("gpu.X1.aliases", "H1", "gpu.X1.aliases must be a list of strings"),
        ("gpu.X1.hbm_gbps", None, "gpu.X1.hbm_gbps = None must be a number"),
        ("gpu.X1.generation", "kepler", "gpu.X1.generation = 'kepler' must be one of"),
    ],
)
def test_a_broken_catalog_names_the_key(path: str, value: object, message: str):
    with pytest.raises(CatalogError, match=r".*") as err:
        parse_catalog(broken(path, value), "my.toml")
    assert str(err.value).startswith("my.toml: ") and message in str(err.value)


def test_load_catalog_from_a_file(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[gpu.X\n")
    with pytest.raises(CatalogError, match="cannot be read as TOML"):
        load_catalog(bad)
    assert load_catalog(None) is default_catalog()


def test_cluster_gpu_must_be_in_the_catalog():
    assert load_config(None, {}, ["cluster.gpu='NVIDIA H100 80GB HBM3'"]).cluster.gpu
    with pytest.raises(ConfigError) as err:
        load_config(None, {}, ["cluster.gpu='H900'"])
    assert "cluster.gpu" in str(err.value) and "known: V100, T4" in str(err.value)


def test_the_catalog_does_not_import_torch():
    code = "import sys, trainwise.hardware.catalog as c; c.default_catalog(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_shipped_gpu_has_memory_bandwidth_and_a_generation():
    for spec in default_catalog().gpus.values():
        assert spec.hbm_bytes_per_s > 0 and spec.generation in GENERATIONS
        assert "Memory bandwidth:" in spec.source  # each figure with its source
