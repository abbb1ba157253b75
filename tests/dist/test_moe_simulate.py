"""The Mixture-of-Experts memory formula (plan/moe/memory.py) against a measurement:
trainwise's MoE model (models/moe) on fake tensors under PyTorch's memory trackers
(trainwise.doctor.simulate), read through its profile as the runtime reads it. The
issue's bar: within 5 % of the per-rank peak, for single, DDP over 2 and FSDP over 2 (fp32
and bf16), and FSDP over 2 with the experts split 2 ways once the runtime splits them
(parallel.ep: pending, skipped while the runtime refuses it). Fake tensors route every
expert an even share (models/moe/layers.py), so the formula is priced at moe.imbalance 1."""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from helpers import hang_limit
from trainwise.config import load_config
from trainwise.config.parallel_dims import ParallelDims
from trainwise.models.moe import MOE_PRESETS
from trainwise.plan.model.memory import Workload, estimate_memory
from trainwise.plan.model.setup import Setup

pytestmark = pytest.mark.timeout(hang_limit(launches=3))

SHAPE = MOE_PRESETS["moe-tiny"]
SEQ, MICRO_BATCH = 128, 4
CASES = {
    "single": (ParallelDims(), "fp32"),
    "ddp 2": (ParallelDims(dp_replicate=2), "fp32"),
    "fsdp 2": (ParallelDims(1, 2, fsdp=True), "fp32"),
    "fsdp 2 bf16": (ParallelDims(1, 2, fsdp=True), "bf16"),
    "fsdp 2 x ep 2": (ParallelDims(1, 2, ep=2, fsdp=True), "fp32"),
}


def ep_runs() -> bool:
    """Whether the runtime splits the experts (the `moeep` work): it refuses parallel.ep
    > 1 until then."""
    from trainwise.run.job.resolve import expert_problems

    cfg = load_config(None, {"model.name": "moe-tiny", "parallel.ep": 2})
    return not expert_problems(cfg, SHAPE)


def _simulate(case: str) -> int:
    from trainwise.doctor.simulate import simulate_layout
    from trainwise.models.moe.model import MoEModel
    from trainwise.models.profile import profile_model

    dims, precision = CASES[case]
    profile = profile_model(lambda: MoEModel(SHAPE), seq_len=SEQ, vocab_size=SHAPE.vocab_size,
                            micro_batch=MICRO_BATCH)
    return simulate_layout(profile, dims, precision, MICRO_BATCH, SEQ).peak_bytes


@pytest.fixture(scope="module")
def simulated() -> dict[str, int]:
    """Every case that runs, two processes at a time (each sets up its own fake process
    group)."""
    cases = [c for c in CASES if CASES[c][0].ep == 1 or ep_runs()]
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(cases, pool.map(_simulate, cases), strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_moe_formula_within_5_percent_of_the_simulated_peak(simulated, case):
    if case not in simulated:
        pytest.skip("pending: the runtime does not split the experts yet (parallel.ep)")
    dims, precision = CASES[case]
    w = Workload(SHAPE.num_params(), None, SEQ, MICRO_BATCH, precision=precision, moe=SHAPE,
                 imbalance=1.0)
    formula = estimate_memory(w, Setup.of(dims, w), "cpu")
    assert formula.peak == pytest.approx(simulated[case], rel=0.05)


def test_plan_simulate_measures_a_moe_preset_beside_its_formula(capsys):
    """`trainwise plan --simulate` builds the MoE model and simulates every named row it
    can play (not ep: pending), each within 5 % of the formula at balanced routing."""
    from trainwise.cli.main import main

    args = ["plan", "--model", "moe-tiny", "--gpus", "2", "--gpu", "cpu", "--seq", "128",
            "--micro-batch", "4", "--global-batch", "8", "--set", "precision.dtype=fp32",
            "--set", "moe.imbalance=1", "--simulate", "--json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)["simulation"]
    assert {r["strategy"] for r in rows} >= {"single", "ddp", "fsdp-full"}
    assert all(abs(r["gap"]) < 0.05 for r in rows), rows
