"""The tensor-parallel communication timer (run.comm_timer) counts exactly the collectives
the TP plan implies and none of FSDP's: the built-in GPT's forward on PyTorch's fake
process group of 2 ranks (collectives are dispatched with their real buffers but move
nothing), in a fresh process so the fake world does not leak into other tests."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

B, S = 4, 64


def _forward_collectives(layout: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainwise.config.parallel_dims import ParallelDims
    from trainwise.models.gpt import GPT
    from trainwise.models.gpt_parallel import gpt_tp_plan
    from trainwise.models.shapes import PRESETS
    from trainwise.run.engine.parallelize import parallelize
    from trainwise.run.observe.comm_timer import CollectiveTimer

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    shape = PRESETS["tiny"]
    model = GPT(shape)
    dims = ParallelDims(tp=2) if layout.startswith("tp") else ParallelDims(1, 2, fsdp=True)
    plan = gpt_tp_plan(model, layout == "tp_sp") if dims.tp > 1 else None
    model = parallelize(model, list(model.blocks), dims, device=torch.device("cpu"), tp_plan=plan)
    timer = CollectiveTimer(torch.device("cpu"))
    with timer, torch.no_grad():
        model(torch.randint(0, shape.vocab_size, (B, S)))
    dist.destroy_process_group()
    return {"by_op": dict(timer.by_op), "calls": timer.calls, "seconds": timer.seconds(),
            "n_layer": shape.n_layer, "d_model": shape.d_model}


@pytest.fixture(scope="module")
def counted() -> dict:
    ctx = multiprocessing.get_context("spawn")
    layouts = ("tp", "tp_sp", "fsdp")
    # One fresh process for the three (each forward destroys its fake group): a second
    # process would import torch again to save a few forwards of the tiny model.
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return dict(zip(layouts, pool.map(_forward_collectives, layouts), strict=True))


def test_tensor_parallel_forward_all_reduces_twice_a_block_and_once_for_the_embedding(counted):
    tp = counted["tp"]
    stream = B * S * tp["d_model"] * 4  # the residual stream of the micro-batch, fp32
    # Row-parallel attention output and MLP down projection; the vocabulary-split embedding.
    assert tp["by_op"] == {("all_reduce", stream): 2 * tp["n_layer"] + 1}
    assert tp["seconds"] > 0


def test_sequence_parallel_gathers_and_scatters_instead(counted):
    sp = counted["tp_sp"]
    stream = B * S * sp["d_model"] * 4
    ops = sp["by_op"]
    assert ops[("reduce_scatter_tensor", stream)] == 2 * sp["n_layer"]
    # Before attention and the MLP of each block, and before the output layer; each rank
    # brings half the sequence.
    assert ops[("all_gather_into_tensor", stream // 2)] == 2 * sp["n_layer"] + 1


def test_fsdp_collectives_are_not_counted(counted):
    assert counted["fsdp"]["calls"] == 0 and counted["fsdp"]["by_op"] == {}
