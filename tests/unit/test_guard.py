"""The non-finite guard's update: a fused optimizer skips a non-finite update on the device,
with no read of a device value in the step (run/engine/guard.py); the others are skipped
by the host, which reads the norm. Both leave the model and its optimizer as they were."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainwise.run.engine.guard import Verdicts
from trainwise.run.engine.step import DataParallelStep


class HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (bool, item: what waits for the
    device on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def stepped(implementation: str, poisoned: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                          bool | torch.Tensor, int]:
    """A linear model after one finite step and then one more (NaN where `poisoned`):
    (model, optimizer, the second update's verdict, its host reads)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1,
                            **{"fused": True} if implementation == "fused" else {"foreach": True})
    step = DataParallelStep(
        torch.nn.functional.cross_entropy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1),
        None, nullcontext, 1, 1.0, torch.device("cpu"),
    )
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    step.step([model], iter([(x, y)]), probe=False)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    (loss * float("nan") if poisoned else loss).backward()
    with HostReads() as reads:
        _, finite = step.update([model])
    return model, opt, finite, reads.count


@pytest.mark.parametrize("poisoned", [True, False])
def test_a_fused_update_skips_itself_on_the_device_and_reads_nothing_back(poisoned: bool):
    model, opt, finite, reads = stepped("fused", poisoned)
    assert reads == 0  # the foreach step below reads the norm: this is the fused path's own
    assert isinstance(finite, torch.Tensor) and bool(finite) is not poisoned
    reference, ref_opt, ref_finite, ref_reads = stepped("foreach", poisoned)
    assert ref_reads >= 1 and ref_finite is not poisoned
    # Skipped or applied alike: parameters, moments and the step count.
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key])
    assert float(opt.state[model.weight]["step"]) == (1 if poisoned else 2)


def test_verdicts_hold_back_the_latest_device_flag_until_asked_now():
    verdicts = Verdicts()
    verdicts.add(1, torch.tensor(True))
    assert verdicts.take() == []  # the step just run: read one step later
    verdicts.add(2, torch.tensor(False))
    assert verdicts.take() == [(1, True)]
    verdicts.add(3, True)  # a verdict the host knew at its step comes at once
    assert verdicts.take() == [(2, False), (3, True)]
    verdicts.add(4, torch.tensor(False))
    assert verdicts.take(now=True) == [(4, False)]
    verdicts.add(5, torch.tensor(True))
    verdicts.add(6, torch.tensor(True))
    verdicts.clear()  # a rollback: the steps after it are undone
    assert verdicts.take(now=True) == []
