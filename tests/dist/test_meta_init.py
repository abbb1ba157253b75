"""Models that never exist whole on one rank: a 2 x 2 (dp_shard x tp) build on the meta
device gives, gathered parameter by parameter, exactly the model one process builds; each
rank holds a quarter of it; and sharded accumulation keeps a quarter of the gradients
where unsharded keeps none sharded (FSDP holds the full ones aside until the sync).
The same launch trains the 2 x 2 job through the engine with a toy model converter (every
Linear swapped for one that counts its calls) and without: the losses are equal, and the
job's mesh gives each tensor-parallel pair one data-parallel rank.
One torchrun launch of 4 gloo workers (tp_worker.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import hang_limit, run_limited, worker_failure
from trainwise.models import ModelSpec, build_model
from trainwise.run.engine.materialize import materialize

WORKER = Path(__file__).with_name("tp_worker.py")
WORLD = 4
pytestmark = [pytest.mark.dist, pytest.mark.timeout(hang_limit(procs=WORLD, steps=6))]


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict]]:
    out = tmp_path_factory.mktemp("meta_init")
    proc = run_limited(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
         "--standalone", str(WORKER), str(out)],
        what=f"tp_worker.py on {WORLD} workers", limit=hang_limit(procs=WORLD, steps=6),
    )
    assert proc.returncode == 0, worker_failure(proc.stderr)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return torch.load(out / "gathered.pt"), ranks


def single_process_model() -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        bundle = build_model(ModelSpec("small", vocab_size=256, seq_len=32))
    materialize(bundle.module, bundle.init_parameter, 0, torch.device("cpu"))
    return dict(bundle.module.named_parameters())


def test_gathered_parameters_equal_the_single_process_init(launched):
    gathered, _ = launched
    single = single_process_model()
    assert gathered.keys() == single.keys()
    for name, value in single.items():
        assert torch.equal(gathered[name], value), name


def test_each_rank_holds_a_quarter_of_the_model(launched):
    _, ranks = launched
    whole = sum(p.numel() * 4 for p in single_process_model().values())
    for figures in ranks:
        assert figures["param_bytes"] <= whole / WORLD * 1.01


def test_sharded_accumulation_keeps_only_sharded_gradients(launched):
    _, ranks = launched
    for figures in ranks:
        assert figures["grad_bytes_sharded"] == figures["param_bytes"]
        assert figures["grad_bytes_unsharded"] == 0  # held unsharded inside FSDP instead


def test_a_toy_converter_trains_the_same_losses_under_fsdp_and_tp(launched):
    _, ranks = launched
    for figures in ranks:
        assert figures["linear_calls"] > 0  # the converter ran: its Linears were called
        assert len(figures["plain_losses"]) == 3
        assert figures["converted_losses"] == figures["plain_losses"]
    assert len({tuple(f["plain_losses"]) for f in ranks}) == 1  # averaged over ranks


def test_the_mesh_gives_each_tensor_parallel_pair_one_data_rank(launched):
    _, ranks = launched
    assert [f["dp_rank"] for f in ranks] == [0, 0, 1, 1]
