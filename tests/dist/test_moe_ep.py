"""Expert parallelism trains one process's Mixture-of-Experts model: two torchrun launches
of moe_ep_worker.py (2 and 4 gloo workers), the tiny MoE's 8 experts split over ep = 2
ranks under DDP's replicas (probed on every step, accumulating), FSDP over 4 (each slice
sharded over 2), HSDP 2 x 2 (every block checkpointed), 2 pipeline stages x FSDP 2,
FSDP 2 x TP 2, and FSDP 2 with every token routed to rank 1's experts, each with the
load-balancing loss and the bias update on, compared with one process (trained here,
without a process group): the losses and their balancing part, the gradient norms, the
held-out loss, every router's bias and the tokens each expert got in each step.

fp32, 1e-5; the biases move by +-rate from the loads' signs, and the routing picks the same
experts, so both are equal exactly."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_env, hang_limit, max_rel_diff, worker_failure

WORKER = Path(__file__).with_name("moe_ep_worker.py")
_spec = importlib.util.spec_from_file_location("moe_ep_worker", WORKER)
moe_ep_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(moe_ep_worker)
RTOL = 1e-5
STEPS = moe_ep_worker.STEPS
CASES = moe_ep_worker.CASES
LIMIT = hang_limit(launches=2, steps=len(CASES) * STEPS * 2, procs=4)
LAYOUTS = {
    "ddp2-ep2": "dp_replicate 2 x dp_shard 1 x tp 1 x ep 2",
    "fsdp4-ep2": "dp_replicate 1 x dp_shard 4 x tp 1 x ep 2",
    "hsdp2x2-ep2": "dp_replicate 2 x dp_shard 2 x tp 1 x ep 2",
    "pp2-fsdp2-ep2": "pp 2 x dp_replicate 1 x dp_shard 2 x tp 1 x ep 2",
    "fsdp2-tp2-ep2": "dp_replicate 1 x dp_shard 2 x tp 2 x ep 2",
    "tp2-ep2": "dp_replicate 1 x dp_shard 1 x tp 2 x ep 2",
    moe_ep_worker.STARVED: "dp_replicate 1 x dp_shard 2 x tp 1 x ep 2",
}
# What a rank holds of each [8, ...] experts weight: 4 experts (ep 2), sharded by FSDP
# over the efsdp ranks beside ep (fsdp 4: 2 of them; fsdp 2 x tp 2: ep borrows the tp
# pair, the 2 shard groups' ranks are efsdp; otherwise 1).
HELD_EXPERTS = {"fsdp4-ep2": 2, "fsdp2-tp2-ep2": 2}

pytestmark = [pytest.mark.dist, pytest.mark.timeout(LIMIT)]


def launch(root: Path, nproc: int) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--standalone", str(WORKER), str(root)],
        env=cli_env(), capture_output=True, text=True, timeout=LIMIT,
    )
    assert proc.returncode == 0, worker_failure(proc.stderr)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Every case's per-rank results, from one launch of each world size."""
    out: dict[str, list[dict]] = {}
    for nproc in sorted({case[0] for case in CASES.values()}):
        results = launch(tmp_path_factory.mktemp(f"moe_ep{nproc}"), nproc)
        out.update({name: [r[name] for r in results] for name in results[0]})
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, dict]:
    """One process's run of each case (computed once, shared by the tests)."""
    return {name: moe_ep_worker.case_run(name, pipeline=False) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_layout_trains_one_processs_model(ranks, reference, name):
    got, want = ranks[name][0], reference[name]
    assert got["layout"] == LAYOUTS[name]
    assert max_rel_diff(got["losses"], want["losses"], STEPS) <= RTOL
    assert max_rel_diff(got["aux"], want["aux"], STEPS) <= RTOL
    assert max_rel_diff(got["grad_norms"], want["grad_norms"], STEPS) <= RTOL
    assert abs(got["eval"] / want["eval"] - 1) <= RTOL
    held = {int(k): v for r in ranks[name] for k, v in r["biases"].items()}
    assert held == {int(k): v for k, v in want["biases"].items()}
    assert any(b != 0 for bias in held.values() for b in bias)  # the update ran


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_holds_its_experts_only(ranks, name):
    for rank in ranks[name]:
        shapes = rank["experts"]
        assert shapes, "no experts held"  # every stage of the tiny model has MoE layers
        assert all(shape[0] == HELD_EXPERTS.get(name, 4) for shape in shapes.values()), shapes


@pytest.mark.parametrize("name", list(CASES))
def test_tokens_per_expert_are_one_processs(ranks, reference, name):
    """The step's tokens per expert, summed over the ranks in the recorder's collective
    (a tensor-parallel pair's halves added), are those one process routes."""
    got = ranks[name][0]["tokens"]
    assert got == reference[name]["tokens"]
    mb, accum, dp = CASES[name][1:4]
    per_layer = mb * accum * dp * 32 * 2  # samples x seq_len x top_k
    assert all(sum(layer) == per_layer for step in got for layer in step)


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_routes_its_share_of_the_tokens(ranks, name):
    """Every rank's routers count their own tokens only: a data-parallel rank its
    samples', a tensor-parallel rank 1 / tp of its group's (the token split), a pipeline
    stage its layers' (of the 2, one each)."""
    mb, accum, dp = CASES[name][1:4]
    tp, pp = (2 if "tp2" in name else 1), (2 if "pp2" in name else 1)
    share = mb * accum * 32 * 2 * (2 // pp) / tp  # samples x seq_len x top_k x layers
    for rank in ranks[name]:
        assert rank["routed"] == [share] * STEPS


def test_every_all_to_all_of_the_step_is_timed(ranks):
    """Dispatch and combine, forward and backward, in each MoE layer of each micro-batch:
    4 x 2 layers x 2 micro-batches a step of ddp2-ep2, whose every step is probed: the
    probe pass's exchanges are not the step's."""
    for rank in ranks["ddp2-ep2"]:
        assert rank["a2a_spans"] == [16] * STEPS
        assert all(s > 0 for s in rank["a2a_s"])


def test_a_rank_whose_experts_get_no_token_trains_with_its_peers(ranks):
    """The starved case: rank 0's experts (0-3) get no row in any layer of any step, so its
    combine all-to-all has nothing of its own to send back, forward and backward. It still
    joins every exchange of backward (a rank that skipped one hung its peers) and its
    expert weights get a gradient for FSDP's reduce-scatter: the case trains one
    process's model (test_layout_trains_one_processs_model)."""
    for step in ranks[moe_ep_worker.STARVED][0]["tokens"]:
        for layer in step:
            assert layer[:4] == [0, 0, 0, 0] and sum(layer[4:]) > 0
