"""Accelerators and interconnects as data (no torch), and detection of this machine's
device (loaded on first use, as it needs torch)."""

from __future__ import annotations

from typing import Any

from trainwise.hardware.catalog import (
    GB,
    TFLOP,
    Catalog,
    CatalogError,
    GPUSpec,
    Link,
    default_catalog,
    find_gpu,
    gpu_names,
    load_catalog,
)

__all__ = [
    "GB",
    "TFLOP",
    "Catalog",
    "CatalogError",
    "DeviceInfo",
    "GPUSpec",
    "Link",
    "default_catalog",
    "detect_device",
    "find_gpu",
    "gpu_names",
    "host_memory_bytes",
    "load_catalog",
]


def __getattr__(name: str) -> Any:
    if name in ("DeviceInfo", "detect_device", "host_memory_bytes"):
        from trainwise.hardware import detect

        return getattr(detect, name)
    raise AttributeError(f"module 'trainwise.hardware' has no attribute {name!r}")
