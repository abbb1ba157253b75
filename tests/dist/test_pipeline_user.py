"""Your own module in pipeline stages trains the same model as one process: one torchrun
launch of user_pp_worker.py (4 gloo workers) runs tests/user_lm.py (embedding -> blocks ->
norm -> head, nothing of trainwise's) cut by its convention into 2 stages x 2 data-parallel
ranks, under FSDP and as replicas, with each block container torch offers, a head tied to
the embedding across ranks, on one rank (the V) and with two stages a rank, the
factory's own loss, and gradient accumulation; each case's losses, gradient norms and
held-out loss are compared with one process's (trained here, without a process group).
pp 2 on 2 workers alone, through the CLI, is tests/faults/test_reshard_pp_user.py's.

fp32, rel 1e-5: the sums run in other orders across stages and shards."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import cli_env, hang_limit, max_rel_diff, worker_failure

WORKER = Path(__file__).with_name("user_pp_worker.py")
_spec = importlib.util.spec_from_file_location("user_pp_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)
TESTS = Path(__file__).parents[1]  # user_lm.py: the workers import it by model.name
LIMIT = hang_limit(launches=len(worker.CASES), steps=worker.STEPS * len(worker.CASES),
                   procs=worker.WORLD)
RTOL = 1e-5

pytestmark = [pytest.mark.dist, pytest.mark.timeout(LIMIT)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("pipeline_user")
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(worker.WORLD),
         "--standalone", str(WORKER), str(root)],
        env=env, capture_output=True, text=True, timeout=LIMIT,
    )
    assert proc.returncode == 0, worker_failure(proc.stderr)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(worker.WORLD)]


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    return {name: worker.case_losses(case, pipeline=False) for name, case in worker.CASES.items()}


@pytest.mark.parametrize("name", list(worker.CASES))
def test_stages_of_your_own_module_train_one_processs_losses(ranks, references, name):
    got, want = ranks[0][name], references[name]
    steps = worker.STEPS
    assert max_rel_diff(got["losses"], want["losses"], steps) <= RTOL
    # The norm clipping and the guard read: completed over the stages, a tied weight once.
    assert max_rel_diff(got["grad_norms"], want["grad_norms"], steps) <= RTOL
    assert abs(got["eval"] / want["eval"] - 1) <= RTOL
    # The last stage's loss reached every rank of the pipeline.
    assert all(r[name]["losses"] == got["losses"] for r in ranks)


@pytest.mark.parametrize("name", list(worker.CASES))
def test_each_rank_holds_its_stages_under_the_whole_models_names(ranks, name):
    strategy, virtual = worker.CASES[name][2], worker.CASES[name][4]
    shard = "dp_replicate 1 x dp_shard 2" if strategy == "fsdp" else "dp_replicate 2 x dp_shard 1"
    assert ranks[0][name]["layout"] == f"pp 2 x {shard} x tp 1"
    # Ranks 0, 1 hold the first pipeline position, 2, 3 the second; each pair reads two shares.
    assert [r[name]["dp_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r[name]["parts"] for r in ranks] == [virtual] * worker.WORLD
    held = set().union(*(r[name]["params"] for r in ranks))
    blocks = {n.split(".")[1] for n in held if n.startswith("layers.")}
    assert blocks == {"0", "1", "2", "3"}  # every block once, under its own key
    assert {"tok_emb.weight", "norm.weight", "head.weight"} <= held
    first = ranks[0][name]["params"]  # the first stage's rank: no final norm, unless the V
    assert ("norm.weight" in first) == (worker.CASES[name][3] == "ZBVZeroBubble")
