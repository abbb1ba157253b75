"""What this machine offers for training: the device kind, its memory and peak rate."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trainwise.hardware.catalog import GPUSpec, find_gpu

FP8_CAPABILITY = (8, 9)  # Ada; Hopper 9.0, Blackwell 10.0


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cpu" or "cuda"
    name: str
    count: int  # devices on this machine (CPU: 1)
    memory_bytes: float  # per device; CPU: the machine's RAM
    bf16: bool
    fp16: bool
    gpu: GPUSpec | None  # catalog entry when known
    capability: tuple[int, int] | None = None  # CUDA compute capability (8, 9): Ada

    @property
    def fp8(self) -> bool:
        """Float8 tensor cores (torch._scaled_mm): compute capability 8.9 or newer."""
        return self.capability is not None and self.capability >= FP8_CAPABILITY

    def peak_flops(self, precision: str) -> float | None:
        return self.gpu.peak(precision) if self.gpu else None


def host_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, which a scheduler may narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def detect_device(kind: str = "auto") -> DeviceInfo:
    """`kind` is cluster.device: auto, cpu or cuda."""
    use_cuda = torch.cuda.is_available() if kind == "auto" else kind == "cuda"
    if use_cuda and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return DeviceInfo(
            kind="cuda",
            name=props.name,
            count=torch.cuda.device_count(),
            memory_bytes=float(props.total_memory),
            bf16=torch.cuda.is_bf16_supported(),
            fp16=True,
            gpu=find_gpu(props.name),
            capability=(props.major, props.minor),
        )
    if use_cuda:
        return DeviceInfo("cuda", "none", 0, 0.0, False, False, None)
    # CPU autocast runs bf16; fp16 training on CPU is not supported by GradScaler paths we use.
    # The catalog's `cpu` entry gives CPU runs a (stated, assumed) peak, so that they record
    # an MFU and can calibrate the planner.
    return DeviceInfo("cpu", "cpu", 1, host_memory_bytes(), True, False, find_gpu("cpu"))
