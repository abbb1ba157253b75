"""Accelerators and interconnects as data (no torch), and detection of this machine's
device (loaded on first use, as it needs torch)."""

from __future__ import annotations

from typing import Any

from trainwise.hardware.catalog import GB, GPUS, TFLOP, GPUSpec, find_gpu

__all__ = [
    "GB",
    "GPUS",
    "TFLOP",
    "DeviceInfo",
    "GPUSpec",
    "detect_device",
    "find_gpu",
    "host_memory_bytes",
]


def __getattr__(name: str) -> Any:
    if name in ("DeviceInfo", "detect_device", "host_memory_bytes"):
        from trainwise.hardware import detect

        return getattr(detect, name)
    raise AttributeError(f"module 'trainwise.hardware' has no attribute {name!r}")
