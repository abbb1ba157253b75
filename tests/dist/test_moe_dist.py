"""A Mixture-of-Experts model trains the same under every layout the runtime runs without
expert parallelism: one torchrun launch of moe_worker.py (4 gloo workers: DDP probed on
every step, FSDP with accumulation, 2 pipeline stages x FSDP 2, FSDP 2 x tensor
parallelism 2), each with the load-balancing loss and the auxiliary-loss-free bias update
on, compared with one process (trained here, without a process group): the losses and
their balancing part, the gradient norms, the held-out loss and every router's bias.

fp32, 1e-5; the biases move by +-rate from the loads' signs, so they are equal exactly."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_env, hang_limit, max_rel_diff, tiny_moe, worker_failure

WORKER = Path(__file__).with_name("moe_worker.py")
_spec = importlib.util.spec_from_file_location("moe_worker", WORKER)
moe_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(moe_worker)
RTOL = 1e-5
LIMIT = hang_limit(launches=2, steps=len(moe_worker.CASES) * moe_worker.STEPS * 2, procs=4)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(LIMIT)]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("moe")
    tiny_moe(folder / "qwen3moe", vocab=98)  # 2-way TP divides the vocabulary
    return folder


@pytest.fixture(scope="module")
def ranks(root: Path) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--standalone", str(WORKER), str(root)],
        env=cli_env(), capture_output=True, text=True, timeout=LIMIT,
    )
    assert proc.returncode == 0, worker_failure(proc.stderr)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(4)]


LAYOUTS = {
    "ddp4": "dp_replicate 4 x dp_shard 1 x tp 1",
    "fsdp4-accum": "dp_replicate 1 x dp_shard 4 x tp 1",
    "pp2-fsdp2": "pp 2 x dp_replicate 1 x dp_shard 2 x tp 1",
    "fsdp2-tp2": "dp_replicate 1 x dp_shard 2 x tp 2",
    "qwen3-fsdp2-tp2": "dp_replicate 1 x dp_shard 2 x tp 2",
}


@pytest.mark.parametrize("name", list(moe_worker.CASES))
def test_layout_trains_one_processs_model(ranks, root, name):
    got, want = ranks[0][name], moe_worker.case_run(name, root, pipeline=False)
    assert got["layout"] == LAYOUTS[name]
    steps = moe_worker.STEPS
    assert max_rel_diff(got["losses"], want["losses"], steps) <= RTOL
    assert max_rel_diff(got["aux"], want["aux"], steps) <= RTOL
    assert max_rel_diff(got["grad_norms"], want["grad_norms"], steps) <= RTOL
    assert abs(got["eval"] / want["eval"] - 1) <= RTOL
    # The balancing loss is part of the loss and was logged: 0.05 x about 1 (balanced).
    assert all(0.04 < a < 0.07 for a in got["aux"])
    # Every router's bias, on whichever rank holds its layer, is one process's.
    held = {int(k): v for r in ranks for k, v in r[name]["biases"].items()}
    assert held == {int(k): v for k, v in want["biases"].items()}
    assert any(b != 0 for bias in held.values() for b in bias)  # the update ran


def test_each_rank_reads_its_experts_only(ranks, root):
    """FSDP over dp_shard 2 holds half the experts a rank (rows of the [E, ...] weights):
    each rank opens those experts' tensors in the files and no other expert's (a TP pair
    the same ones), and a slice of every other tensor."""
    from safetensors import safe_open

    with safe_open(str(root / "qwen3moe" / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    experts = sum(".experts." in k for k in keys)
    assert experts == 2 * 4 * 3  # layers x experts x (gate, up, down)
    reads = [r["qwen3-fsdp2-tp2"]["read"] for r in ranks]
    assert all(r["tensors_read"] == len(keys) - experts // 2 for r in reads), reads
    assert all(r["bytes_read"] < r["bytes_total"] / 2 for r in reads), reads
