"""How fast one GPU runs a matrix multiplication of a given shape, and its attention: the
per-generation efficiencies the compute model (plan.compute) prices operations with, and
the measured table (`GemmTable`) a calibration replaces them with.

A GEMM of shape (M, N, K) does 2·M·N·K FLOPs. Its time is the larger of
- its FLOPs at the generation's large-GEMM rate (`gemm_share` of the dense peak), after
  tile quantization (each dimension padded to the kernel's output tile) and wave
  quantization (the tiles run in waves of one per SM: a last partial wave idles the rest;
  a GEMM of fewer tiles than SMs splits K over them, cuBLAS's split-K),
  NVIDIA, "Matrix Multiplication Background User's Guide" (Deep Learning Performance docs),
  sections "Tile Quantization" and "Wave Quantization";
  plus, for every wave, its epilogue: each SM writes its output tile to memory at its share
  of the memory bandwidth (TILE x TILE x 2 bytes at hbm/SMs: 1.29 us a wave on an H100
  SXM) before the next wave's tiles start, a fixed cost that a short K amortizes badly.
  OpenXLA's measured H100 table (xla/service/gpu/model/matmul_interpolator_data.h, sm_90,
  bf16) shows it: 4096 x 4096 outputs (8 waves) take 10.5 us + 0.040 us x K (K = 256 to
  4096), 1.3 us a wave;
- and its bytes (the two inputs read, the output written) at the memory bandwidth: a thin
  GEMM is memory-bound (ibid., "Math And Memory Bounds").

The large-GEMM shares are the maximum sustainable matmul FLOPS (MSMF: torch.matmul in
bf16 on the best shape, the GPU saturated at its power limit, "the sustained rate that
matches real training throughput"), else the maximum achievable (MAMF, a boost-clock
burst): S. Bekman, ml-engineering, compute/accelerator/benchmarks/README.md ("What we
measured: alone vs all-8 concurrent") and compute/accelerator/README.md ("Maximum
Achievable Matmul FLOPS comparison table").
Attention runs as SDPA's flash kernel: FlashAttention-2 reaches 50-73 % of the A100's peak
forward and backward (Dao, 2023, "FlashAttention-2", abstract and section 4.1) and at most
35 % of the H100's (Shah et al., 2024, "FlashAttention-3", abstract); causal with head dim
128 at 8192 tokens, forward 284.1 and backward 287.1 TFLOPS (Dao-AILab/flash-attention
PR #1791: hopper/benchmark_attn.py, FlashAttention-3's benchmark, which runs on Hopper
GPUs only; the GPU's model is not stated): 0.29 of the H100's peak.
PyTorch's SDPA flash backend is FlashAttention-2.

Float8 GEMMs (torch._scaled_mm, what torchao's float8 training runs: plan.model.float8)
run at `fp8_gemm_share` of the dense fp8 peak, with fp8 inputs (1 byte an element) and a
16-bit output. Hopper's share: 8192 x 8192 x 16384 in fp8 reached 1,541 TFLOPS on an H800
SXM (the H100 SXM's SMs, clocks and fp8 peak, 1,979 dense; xwhzz/tilelang
benchmark/matmul_fp8/README.md at 6b1faf71: a TileLang kernel on one GPU alone, a burst
like MAMF), 0.779 of the peak, at the sustained/burst ratio of H200 bf16 (698.6 / 823.9,
all 8 busy vs alone: the assumption Ampere's share makes too): 0.660. A generation without
a published fp8 figure keeps Hopper's fp8/bf16 ratio to its own bf16 share (an
assumption: FP8_SHARE_RATIO).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# Assumption: cuBLAS's large bf16 kernels write 128 x 128 output tiles (the guide's
# examples; Hopper's also run 128 x 256).
TILE = 128
# Tensor cores compute in steps of 16 along each dimension (the guide's "multiples of 8 or
# 16" rule for fp16/bf16 tensor-core use).
MMA = 16


@dataclass(frozen=True)
class Generation:
    """What a GPU architecture achieves: `gemm_share` of the dense peak on large GEMMs,
    `attention_share` in SDPA's flash kernel (forward and backward), `sms` streaming
    multiprocessors (compute units) of its flagship part, for wave quantization."""

    gemm_share: float
    attention_share: float
    sms: int
    source: str
    tile: int = TILE
    # K of the shape `gemm_share` was measured on: its epilogues are part of that share,
    # so the math rate is the share with them taken out (0: none taken out).
    reference_k: int = 0
    # The spread (max - min over the mean) of the sustained rate across a node's GPUs, all
    # busy at once (0: none published); gemm_share is their mean.
    clock_spread: float = 0.0
    # The SM clock (MHz) `gemm_share` was measured at, the middle of the node's range (0:
    # not published): cluster.sustained_clock_mhz scales the rates by its ratio to it.
    clock_mhz: float = 0.0
    # Float8 GEMMs (module docstring): the share of the dense fp8 peak on large shapes and
    # the K it was measured at (0: none published; float8_generation derives them).
    fp8_gemm_share: float = 0.0
    fp8_reference_k: int = 0


GENERATIONS: dict[str, Generation] = {
    "ampere": Generation(
        0.728, 0.6, 108,
        "MAMF A100 SXM 267.9 of 312 TFLOPS (85.9 %) at H200's sustained/burst ratio "
        "(698.6 / 823.9: an assumption, no A100 MSMF published); FlashAttention-2 50-73 % "
        "of A100 peak (0.6: the middle); A100 whitepaper: 108 SMs",
        reference_k=5120,  # the MAMF shape 1024 x 10240 x 5120
    ),
    "hopper": Generation(
        0.706, 0.29, 132,
        "MSMF H200 698.6 of 989 TFLOPS, all 8 GPUs of a node busy (H100 SXM: the same chip "
        "and 700 W); FlashAttention-2 on H100, head dim 128, causal, seq 8192: forward "
        "284.1, backward 287.1 TFLOPS, 0.29 of 989 over a step's 1 + 2.5 "
        "(Dao-AILab/flash-attention PR #1791, hopper/benchmark_attn.py on main; the "
        "FlashAttention-3 paper's 35 % is FA2's best, non-causal); H100 SXM5: 132 SMs",
        reference_k=20480,  # the MSMF shape 8192 x 8448 x 20480
        clock_spread=0.045,  # H200, all 8 busy: MSMF range 4.5 % (1405-1527 MHz)
        clock_mhz=1466.0,  # the middle of 1405-1527 MHz
        fp8_gemm_share=0.660,  # 1,541 of 1,979 TFLOPS (H800 SXM) x 698.6 / 823.9
        fp8_reference_k=16384,  # the shape 8192 x 8192 x 16384
    ),
    "blackwell": Generation(
        0.634, 0.29, 148,
        "MSMF B200 1426.4 of 2250 TFLOPS, all 8 GPUs busy; attention: assumed as Hopper's "
        "FlashAttention-2 share (no published SDPA figure); B200: 148 SMs",
        reference_k=20480,  # the MSMF shape 9472 x 8192 x 20480
        clock_spread=0.104,  # B200, all 8 busy: MSMF range 10.4 % (1228-1410 MHz)
        clock_mhz=1319.0,  # the middle of 1228-1410 MHz
    ),
    "cdna3": Generation(
        0.601, 0.3, 304,
        "MAMF MI300X 781.9 of 1300 TFLOPS (it runs at its power cap at once: no burst "
        "above the sustained rate); attention: an assumption (ROCm's flash kernel, no "
        "published share); MI300X: 304 CUs",
    ),
    # Older parts: an assumption, Ampere's shares (the tensor-core GEMM kernels are alike).
    "volta": Generation(0.728, 0.6, 80, "assumed as Ampere; V100: 80 SMs", reference_k=5120),
    "turing": Generation(0.728, 0.6, 40, "assumed as Ampere; T4: 40 SMs", reference_k=5120),
    "ada": Generation(0.728, 0.6, 58, "assumed as Ampere; L4: 58 SMs", reference_k=5120),
    # A CPU runs a GEMM on its cores: the planner's former single efficiency (0.4 of an
    # assumed peak), no tiles, no waves.
    "cpu": Generation(0.4, 0.4, 1, "assumption: 0.4 of the catalog's assumed CPU peak", tile=1),
}

# A generation without a published fp8 share: Hopper's fp8 share over its bf16 share times
# its own bf16 share (an assumption).
FP8_SHARE_RATIO = GENERATIONS["hopper"].fp8_gemm_share / GENERATIONS["hopper"].gemm_share


def float8_generation(gen: Generation) -> Generation:
    """`gen` as its float8 GEMMs run: the fp8 share of the fp8 peak (and the K it was
    measured at) in place of the bf16 one; the tiles, waves and epilogues as before."""
    share = gen.fp8_gemm_share or gen.gemm_share * FP8_SHARE_RATIO
    return replace(gen, gemm_share=share, reference_k=gen.fp8_reference_k or gen.reference_k)


# Fused attention kernels beyond SDPA's FlashAttention-2: FlashAttention-3 (Shah et al.,
# 2024) and cuDNN's (what Transformer Engine runs), within 5 % of each other on Hopper
# (Dao-AILab/flash-attention issue #1310, an H20). On an H100 in bf16, causal, head dim 128,
# 4096 tokens, batch 4 x 48 heads: forward 1236.9 us, backward 4643.5 us
# (meta-pytorch/tritonbench PR #1267), 667 and 444 TFLOPS: 0.496 of 989 over a step's
# forward and 2.5 times it backward. Only Hopper has a published figure.
FUSED_ATTENTION_SHARE = {"hopper": 0.496}


@dataclass(frozen=True)
class GemmTable:
    """Measured GEMMs of one device and dtype (doctor.gemm.measure_gemm_table): each shape
    (m, n, k) with its achieved FLOP/s. Replaces the generation's large-GEMM share."""

    device: str
    dtype: str
    shapes: tuple[tuple[int, int, int], ...]
    flops_per_s: tuple[float, ...]
    peak_flops: float | None = None  # the catalog's peak it was measured against, if known

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "peak_flops": self.peak_flops,
            "gemms": [
                {"m": m, "n": n, "k": k, "flops_per_s": r}
                for (m, n, k), r in zip(self.shapes, self.flops_per_s, strict=True)
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> GemmTable:
        gemms = data["gemms"]
        return cls(
            device=str(data["device"]),
            dtype=str(data["dtype"]),
            shapes=tuple((int(g["m"]), int(g["n"]), int(g["k"])) for g in gemms),
            flops_per_s=tuple(float(g["flops_per_s"]) for g in gemms),
            peak_flops=data.get("peak_flops"),
        )

    def rate(self, m: int, n: int, k: int) -> float:
        """The achieved FLOP/s of the measured shape nearest (m, n, k) in log space."""

        def distance(shape: tuple[int, int, int]) -> float:
            return sum(abs(math.log(a / b)) for a, b in zip(shape, (m, n, k), strict=True))

        nearest = min(range(len(self.shapes)), key=lambda i: distance(self.shapes[i]))
        return self.flops_per_s[nearest]


def quantized(x: int, tile: int) -> int:
    return tile * math.ceil(x / tile)


def _padded(x: int, tile: int) -> int:
    """A dimension as the kernel computes it: whole tiles, or for one narrower than a tile
    (a kernel with smaller tiles), whole tensor-core steps."""
    return quantized(x, tile) if x >= tile else quantized(x, min(MMA, tile))


def gemm_seconds(
    m: int,
    n: int,
    k: int,
    peak_flops: float,
    hbm_bps: float,
    element_bytes: int,
    gen: Generation,
    table: GemmTable | None = None,
    input_bytes: int | None = None,
) -> float:
    """Seconds of one (m, n, k) GEMM: the larger of its math and its memory time (module
    docstring); a measured `table` gives the math rate instead of the generation.
    `element_bytes`: of its output (and inputs, unless `input_bytes` says otherwise: a
    float8 GEMM reads 1-byte inputs and writes 16-bit outputs)."""
    if min(m, n, k) <= 0:
        return 0.0
    inputs = element_bytes if input_bytes is None else input_bytes
    memory = ((m * k + k * n) * inputs + m * n * element_bytes) / hbm_bps
    if table is not None:
        return max(2.0 * m * n * k / table.rate(m, n, k), memory)
    mp, np_, kp = _padded(m, gen.tile), _padded(n, gen.tile), _padded(k, MMA)
    tiles = math.ceil(m / gen.tile) * math.ceil(n / gen.tile)
    # Fewer tiles than SMs: cuBLAS splits K over the idle ones (split-K), up to one wave.
    split = max(1, min(gen.sms // tiles, math.ceil(k / gen.tile)))
    units = tiles * split
    waves = math.ceil(units / gen.sms)
    wave_use = units / (waves * gen.sms)
    rate = peak_flops * math_share(gen, peak_flops, hbm_bps, element_bytes)
    math_s = 2.0 * mp * np_ * kp / (rate * wave_use)
    # Each wave's tiles (of at most TILE x TILE outputs) written by up to one SM each.
    tile_bytes = min(mp, gen.tile) * min(np_, gen.tile) * element_bytes
    epilogue_s = waves * min(units, gen.sms) * tile_bytes / hbm_bps
    return max(math_s + epilogue_s, memory)


def grouped_gemm_seconds(
    groups: int,
    m: float,
    n: int,
    k: int,
    peak_flops: float,
    hbm_bps: float,
    element_bytes: int,
    gen: Generation,
    table: GemmTable | None = None,
) -> float:
    """Seconds of `groups` GEMMs of (m, n, k) run as one grouped GEMM: a Mixture-of-Experts
    layer's experts, each on the m rows routed to it (torch._grouped_mm; m may be an
    average, rounded up). One kernel computes every group's tiles (CUTLASS's grouped GEMM,
    examples/24_gemm_grouped: its thread blocks walk the problems' tiles in turn), so the
    waves are shared across the groups, while each group pads its own m to whole tiles (or
    tensor-core steps when narrower than a tile): fewer rows per expert waste more of each
    tile, and below a tile's rows the experts' weights, read once per group, make it
    memory-bound. There is no split-K across groups. A measured `table` gives the math
    rate of the nearest single GEMM instead."""
    rows = math.ceil(m)
    if groups <= 0 or min(rows, n, k) <= 0:
        return 0.0
    memory = groups * (rows * k + k * n + rows * n) * element_bytes / hbm_bps
    if table is not None:
        return max(groups * 2.0 * rows * n * k / table.rate(rows, n, k), memory)
    mp, np_, kp = _padded(rows, gen.tile), _padded(n, gen.tile), _padded(k, MMA)
    tiles = groups * math.ceil(rows / gen.tile) * math.ceil(n / gen.tile)
    waves = math.ceil(tiles / gen.sms)
    wave_use = tiles / (waves * gen.sms)
    rate = peak_flops * math_share(gen, peak_flops, hbm_bps, element_bytes)
    math_s = groups * 2.0 * mp * np_ * kp / (rate * wave_use)
    tile_bytes = min(mp, gen.tile) * min(np_, gen.tile) * element_bytes
    epilogue_s = waves * min(tiles, gen.sms) * tile_bytes / hbm_bps
    return max(math_s + epilogue_s, memory)


def epilogue_seconds(gen: Generation, hbm_bps: float, element_bytes: int) -> float:
    """One full wave's epilogue: every SM writes a TILE x TILE output tile."""
    return gen.sms * gen.tile * gen.tile * element_bytes / hbm_bps


def math_share(gen: Generation, peak_flops: float, hbm_bps: float, element_bytes: int) -> float:
    """The share of the peak a GEMM's math runs at between epilogues: the generation's
    measured share with the epilogues of its reference shape (one wave of full tiles over
    reference_k) taken out."""
    if not gen.reference_k:
        return gen.gemm_share
    mainloop = 2.0 * gen.tile * gen.tile * gen.reference_k * gen.sms / (
        peak_flops * gen.gemm_share
    )
    # mainloop = math + epilogue at the reference shape
    return gen.gemm_share / (1 - epilogue_seconds(gen, hbm_bps, element_bytes) / mainloop)


def slowest_pace(gen: Generation, gpus: int) -> float:
    """The slowest of `gpus` GPUs that wait for each other (every collective of a step),
    as a share of the mean sustained rate: GPUs of one kind settle at different clocks at
    their power limit (Bekman, ml-engineering compute/accelerator/benchmarks/README.md,
    "What we measured: alone vs all-8 concurrent"), and a synchronous step runs at the
    slowest one's. Assumption: rates spread evenly over the published range, so the
    slowest of n sits range/(n+1) above its bottom."""
    if gpus <= 1 or not gen.clock_spread:
        return 1.0
    return 1.0 - gen.clock_spread * (0.5 - 1.0 / (gpus + 1))


def attention_seconds(
    flops: float, peak_flops: float, gen: Generation, share: float | None = None
) -> float:
    """Seconds of `flops` of SDPA's flash attention (forward and backward), or of a kernel
    running at `share` of the peak (FUSED_ATTENTION_SHARE)."""
    return flops / (peak_flops * (share or gen.attention_share))
