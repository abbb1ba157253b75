"""The network model (plan/model/network.py) against published nccl-tests bus bandwidths, and its
properties. Each figure names its source; the tolerance is stated where it is checked."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainwise.hardware.catalog import default_catalog
from trainwise.plan.model.network import (
    Fabric,
    Group,
    bus_bandwidth,
    collective,
    group_of,
    nic_bps_from_rail_busbw,
)

GB = 1e9
LINKS = default_catalog().links


def _node(intra: str, inter: str, gpus: int = 8, nics: int | None = None) -> Fabric:
    a, b = LINKS[intra], LINKS[inter]
    return Fabric(
        gpus, a.nccl_bytes_per_s, b.nccl_bytes_per_s, nics, a.step_s, b.step_s
    )


DGX_A100 = _node("nvlink3", "ib-hdr")  # 8 x A100, 8 x HDR 200 Gb/s
DGX_H100 = _node("nvlink4", "ib-ndr")  # 8 x H100 (or H200), 8 x NDR 400 Gb/s
BIG = 8 * 2**30  # nccl-tests' largest usual size (-e 8G)


def test_dgx_a100_multi_node_all_reduce():
    # "On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and we measure 192GB/s
    # AllReduce BusBW" (NVIDIA, NVIDIA/nccl issue #812), beyond two nodes (rings). Within 5 %.
    busbw = bus_bandwidth("all_reduce", BIG, Group(32, 8), DGX_A100)
    assert busbw == pytest.approx(192 * GB, rel=0.05)


def test_h100_ndr_ring_is_the_nodes_nics_together():
    # "For NDR @ 400Gbps you should see 46-48GB/s per NIC" (NVIDIA, NVIDIA/nccl-tests issue
    # #290): 8 NICs, 368-384 GB/s of ring busbw on 8 H100 nodes; NVLink does not bind.
    ring = collective("all_gather", BIG, Group(64, 8), DGX_H100)
    assert ring.algorithm == "ring"
    assert 368 * GB <= ring.bus_bytes / ring.seconds <= 384 * GB


def test_h200_at_248_nodes_default_algorithm():
    # 248 nodes of 8 H200 and 8 NDR NICs, all_reduce_perf at 512 MB with NCCL's default
    # algorithm: "typically measuring around 350G" (NVIDIA/nccl-tests issue #283). At this
    # scale the ring's 3,966 steps cost more than the tree's; within 10 %.
    cost = collective("all_reduce", 512 * 2**20, Group(1984, 8), DGX_H100)
    assert cost.algorithm == "tree"
    assert cost.bus_bytes / cost.seconds == pytest.approx(350 * GB, rel=0.10)


def test_two_nodes_tree_beats_the_network_bound():
    # On two nodes NCCL's tree all-reduce reports a busbw beyond the NICs' (S. Jeaugey,
    # NVIDIA/nccl-tests issue #196; NVIDIA/nccl issue #812). Measured: 338.8 GB/s at 8 GB
    # on two A3 Mega nodes (8 H100, 8 x 200 Gb/s NICs: 200 GB/s a node) in
    # lessizzmore/create-a3mega-ztan-fork, file ztan-NCCL-test-result. The NIC's share
    # NCCL reaches over GPUDirect-TCPXO is unpublished (line rate here): within 12 %.
    a3mega = replace(DGX_H100, nic_bps=25 * GB)
    cost = collective("all_reduce", BIG, Group(16, 8), a3mega)
    assert cost.algorithm == "tree"
    busbw = cost.bus_bytes / cost.seconds
    assert busbw > 8 * 25 * GB
    assert busbw == pytest.approx(338.8 * GB, rel=0.12)


def test_one_node_is_the_nvlink_figure():
    # 8 H100: ring busbw ~370 GB/s (S. Jeaugey, NVIDIA/nccl-tests issue #212), the catalog's
    # NVLink 4 as NCCL reaches it.
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        busbw = bus_bandwidth(op, BIG, Group(8, 8), DGX_H100)
        assert busbw == pytest.approx(LINKS["nvlink4"].nccl_bytes_per_s, rel=0.01)
        assert busbw == pytest.approx(370 * GB, rel=0.01)


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce", "send_recv"])
@pytest.mark.parametrize("ranks,per_node", [(16, 8), (64, 8), (64, 4), (8, 1), (1024, 8)])
@pytest.mark.parametrize("size", [2**20, 2**27, BIG])
def test_more_nics_or_bandwidth_is_never_slower(op, ranks, per_node, size):
    group = Group(ranks, per_node)
    base = collective(op, size, group, replace(DGX_H100, nics_per_node=2)).seconds
    for faster in (
        replace(DGX_H100, nics_per_node=4),
        replace(DGX_H100, nics_per_node=8),
        replace(DGX_H100, nics_per_node=2, nic_bps=2 * DGX_H100.nic_bps),
        replace(DGX_H100, nics_per_node=2, intra_bps=2 * DGX_H100.intra_bps),
    ):
        assert collective(op, size, group, faster).seconds <= base


def test_groups_sharing_a_node_share_its_nics():
    # tp 2 inside a node: each FSDP group has 4 ranks a node, next to another one: 4 NICs.
    assert group_of(512, 2, 8) == Group(512, 4)
    assert DGX_H100.nics_for(4) == 4
    assert group_of(16, 8, 8) == Group(16, 1)  # HSDP's replicas: one rank a node, one NIC
    assert replace(DGX_H100, nics_per_node=1).nics_for(8) == 1


def test_calibration_maps_rail_busbw_back_to_a_nic():
    # The doctor times rails (one rank a node, all at once): with a NIC per GPU the rail's
    # busbw is a NIC's; with 4 NICs for 8 GPUs, half of one.
    assert nic_bps_from_rail_busbw(45 * GB, DGX_H100) == 45 * GB
    half = replace(DGX_H100, nics_per_node=4)
    assert nic_bps_from_rail_busbw(22.5 * GB, half) == 45 * GB
    # And back: the model's rail busbw at that NIC is what was measured.
    rail = bus_bandwidth("all_reduce", BIG, Group(16, 1), replace(half, nic_bps=45 * GB))
    assert rail == pytest.approx(22.5 * GB, rel=0.01)


def test_nemo_llama3_70b_fsdp_is_not_communication_bound():
    # NeMo AutoModel's Llama 3 70B, FSDP 32 x CP 2 on 64 H100 (8 nodes), 18.9 s a step
    # (NVIDIA-NeMo/Automodel docs/performance-summary.mdx, as issue 24 cites it). An FSDP
    # group is 32 ranks 2 apart: 4 a node, beside the other CP rank's group. Assumption
    # (the batch is not restated here): 4 micro-batches, each gathering the bf16
    # parameters for forward and backward, and one fp32 reduce-scatter a step.
    params = 70.6e9
    group = group_of(32, 2, 8)
    gathers = collective("all_gather", 2 * params, group, DGX_H100).seconds
    scatter = collective("reduce_scatter", 4 * params, group, DGX_H100).seconds
    step_comm = 4 * 2 * gathers + scatter
    assert step_comm < 0.5 * 18.9  # hides behind the compute, with room
    # The old model (each GPU's bytes through its own 47 GB/s NIC) could not carry it.
    own_nic = replace(DGX_H100, nics_per_node=2)  # 2 NICs: 1 for each 4-rank group
    old = 4 * 2 * collective("all_gather", 2 * params, group, own_nic).seconds
    assert old > 18.9
