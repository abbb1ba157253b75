"""Accelerators and interconnects as data, and detection of this machine's device."""

from trainwise.hardware.catalog import GB, GPUS, TFLOP, GPUSpec, find_gpu
from trainwise.hardware.detect import DeviceInfo, detect_device, host_memory_bytes

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
