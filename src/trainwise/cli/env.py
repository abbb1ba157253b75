"""`trainwise env`: this machine's environment as a block to paste into a bug report."""

from __future__ import annotations

import argparse
import os
import platform
from importlib import metadata

PACKAGES = ("numpy", "pydantic", "rich", "safetensors", "matplotlib", "transformers")
VARIABLES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "MASTER_ADDR")
PREFIXES = ("NCCL_", "TORCH_")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="print this machine's environment for a bug report")
    p.set_defaults(run=run)


def _row(label: str, value: str) -> str:
    return f"{label:<14}{value}"


def environment_lines() -> list[str]:
    import torch

    from trainwise.run.job.versions import local_versions

    v = local_versions()
    lines = [
        _row("trainwise", f"{v['trainwise']} (code {v['code']})"),
        _row("python", f"{v['python']} ({platform.python_implementation()})"),
        _row("os", platform.platform()),
        _row("cpu", f"{os.cpu_count()} cores, {platform.machine()}"),
        _row("torch", v["torch"]),
        _row("cuda", f"{v['cuda']}, cudnn {v['cudnn']}, nccl {v['nccl']}, driver {v['driver']}"),
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(_row(f"gpu {i}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB"))
    else:
        lines.append(_row("gpu", "none visible"))
    import torch.distributed as dist

    backends = [b for b in ("gloo", "nccl", "mpi") if getattr(dist, f"is_{b}_available")()]
    lines.append(_row("backends", ", ".join(backends) or "none"))
    for name in PACKAGES:
        try:
            lines.append(_row(name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            lines.append(_row(name, "not installed"))
    shown = [k for k in sorted(os.environ) if k in VARIABLES or k.startswith(PREFIXES)]
    lines += [_row("env", f"{k}={os.environ[k]}") for k in shown]
    return lines


def run(args: argparse.Namespace) -> int:
    print("\n".join(environment_lines()))
    return 0
