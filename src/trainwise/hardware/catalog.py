"""The hardware catalog: accelerators as data, each figure with its source.

Peak rates are dense (no structured sparsity) tensor-core figures from the vendors'
datasheets. Prices are typical on-demand cloud list prices per GPU-hour (late 2025) and
are assumptions: set `cost.price_per_gpu_hour` for your own contract.
"""

from __future__ import annotations

from dataclasses import dataclass

TFLOP = 1e12
GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: float
    peak_flops: dict[str, float]  # by precision: fp32 (TF32 tensor cores where present), bf16, fp16
    price_per_hour: float
    source: str
    aliases: tuple[str, ...] = ()

    def peak(self, precision: str) -> float | None:
        return self.peak_flops.get(precision)


GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        GPUSpec(
            "H200",
            141 * GB,
            {"fp32": 494 * TFLOP, "bf16": 989 * TFLOP, "fp16": 989 * TFLOP},
            price_per_hour=4.00,
            source="NVIDIA H200 datasheet (SXM, dense)",
        ),
        GPUSpec(
            "H100",
            80 * GB,
            {"fp32": 494 * TFLOP, "bf16": 989 * TFLOP, "fp16": 989 * TFLOP},
            price_per_hour=3.00,
            source="NVIDIA H100 datasheet (SXM5, dense)",
            aliases=("H100 80GB", "H100 SXM"),
        ),
        GPUSpec(
            "A100-80GB",
            80 * GB,
            {"fp32": 156 * TFLOP, "bf16": 312 * TFLOP, "fp16": 312 * TFLOP},
            price_per_hour=1.80,
            source="NVIDIA A100 datasheet (SXM4 80GB, dense)",
            aliases=("A100 80GB", "A100-SXM4-80GB"),
        ),
        GPUSpec(
            "A100-40GB",
            40 * GB,
            {"fp32": 156 * TFLOP, "bf16": 312 * TFLOP, "fp16": 312 * TFLOP},
            price_per_hour=1.30,
            source="NVIDIA A100 datasheet (SXM4 40GB, dense)",
            aliases=("A100", "A100-SXM4-40GB"),
        ),
        GPUSpec(
            "L4",
            24 * GB,
            {"fp32": 60 * TFLOP, "bf16": 121 * TFLOP, "fp16": 121 * TFLOP},
            price_per_hour=0.80,
            source="NVIDIA L4 datasheet (dense)",
        ),
        GPUSpec(
            "V100",
            32 * GB,
            {"fp32": 15.7 * TFLOP, "fp16": 125 * TFLOP},
            price_per_hour=2.50,
            source="NVIDIA V100 datasheet (SXM2 32GB); no bf16",
        ),
    ]
}


def find_gpu(name: str) -> GPUSpec | None:
    """Catalog entry for a user-given name or a CUDA device name ('NVIDIA H100 80GB HBM3')."""
    wanted = name.upper().replace("NVIDIA", "").strip()
    for spec in GPUS.values():
        if wanted == spec.name.upper() or wanted in (a.upper() for a in spec.aliases):
            return spec
    # Device names carry extra words; take the longest catalog name they contain.
    hits = [s for s in GPUS.values() if s.name.upper().split("-")[0] in wanted]
    if not hits:
        return None
    hits.sort(key=lambda s: ("80GB" in wanted) == ("80GB" in s.name.upper()), reverse=True)
    return hits[0]
