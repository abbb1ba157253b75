"""doctor.gemm on CPU with tiny shapes: a table the planner can read back."""

from __future__ import annotations

from trainwise.doctor.gemm import measure_gemm_table
from trainwise.plan.model.gemm import GemmTable


def test_a_cpu_gemm_sweep_round_trips():
    table = measure_gemm_table("cpu", "fp32", shapes=((32, 64, 16), (64, 64, 64)), iterations=2)
    assert len(table.flops_per_s) == 2 and all(r > 0 for r in table.flops_per_s)
    again = GemmTable.from_dict(table.to_dict())
    assert again == table
    assert again.rate(60, 64, 60) == table.flops_per_s[1]  # the nearest measured shape
