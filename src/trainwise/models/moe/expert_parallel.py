"""Expert parallelism: the routed experts (`layers.GroupedExperts`, weights [E, ...]) split
over the ranks of an ep mesh, each holding E / ep of them (Shard(0)), and the tokens sent
to their experts' ranks and back by all-to-all, as a ParallelStyle (torchtitan's
ExpertParallel) that `parallelize_module` applies to the experts module.

The MoE layer hands GroupedExperts its token copies sorted by expert over all E experts,
with the count of each (num_tokens_per_expert [E]); the style's input function replaces
them by the rows this rank's experts must run, its output function hands back the rows the
layer sent, in its order:

- dispatch: the counts first (an even all-to-all of [ep, E / ep]: what this rank sends each
  rank's experts), so that every rank knows what it receives; the split sizes are read on
  the host (the dispatch's one device-to-host sync, as torchtitan's); then the rows, each
  rank's run for another rank's experts being contiguous (all_to_all_single with uneven
  splits). They arrive rank-major (from rank 0 its rows for my experts in order, then rank
  1's...); a stable sort by local expert makes each expert's rows one run again (from
  rank 0's first), which GroupedExperts runs with the local counts: its grouped GEMM or
  its per-expert loop, unchanged.
- combine: the inverse permutation, then the all-to-all back with the splits swapped.

Both exchanges are torch's functional all_to_all_single (torch.distributed.
_functional_collectives), which autograd differentiates: its backward is the all-to-all
with the splits swapped, so the gradients of the rows travel back the way they came.

On tensors without values (the meta device, the doctor's fake-tensor simulation) there are
no counts to read: the rows stay where they are and the rank's experts run them (the same
shapes and FLOPs as a balanced exchange).

`timer` (duck-typed: `mark()` and `add(start, end)`, run.observe.telemetry.Spans) is given
each exchange's span, forward and backward (two identity autograd functions around each
all-to-all mark its backward); the runtime reports their sum as the step's all-to-all time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class ExpertParallel(ParallelStyle):
    """Shards a GroupedExperts' [E, ...] weights on dim 0 over a 1-D ep mesh and exchanges
    its rows by all-to-all (see the module's docstring). One instance may be applied to
    many modules: each gets its own exchange state."""

    def __init__(self, timer: Any = None):
        super().__init__()
        self.timer = timer

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        exchange = TokenExchange(self.timer)
        return distribute_module(
            module, device_mesh, _shard_experts, exchange.dispatch, exchange.combine
        )


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Every [E, ...] parameter of the experts module, Shard(0): E / ep experts a rank."""
    for key, param in list(module.named_parameters(recurse=False)):
        whole = param.data.to_local() if isinstance(param.data, DTensor) else param.data
        sharded = distribute_tensor(whole, mesh, [Shard(0)])  # a tp replica: whole
        module.register_parameter(key, nn.Parameter(sharded, param.requires_grad))


class TokenExchange:
    """One experts module's dispatch and combine; what dispatch learnt (the splits and the
    permutation) is kept for the combine of the same forward."""

    def __init__(self, timer: Any = None):
        self.timer = timer
        self.splits: tuple[list[int], list[int]] | None = None  # (sent, received) per rank
        self.order: torch.Tensor | None = None

    def dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        rows, counts = inputs
        if is_fake(rows) or rows.device.type == "meta":
            self.splits = None
            return rows, counts
        start = self._mark()
        ep = mesh.size()
        with torch.no_grad():
            # Row i of [ep, E / ep]: what rank i sends my experts, each.
            received = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, mesh))
            received = received.view(ep, -1)
            splits = torch.stack([counts.view(ep, -1).sum(1), received.sum(1)]).tolist()
        sent, got = splits
        self.splits = (sent, got)
        routed = _exchange(rows, got, sent, mesh, self.timer)
        local = received.shape[1]
        # Each received row's local expert, rank-major; sorted stably, expert-major.
        expert = torch.arange(local, device=rows.device).repeat(ep)
        self.order = expert.repeat_interleave(
            received.reshape(-1), output_size=sum(got)  # known on the host: no sync
        ).argsort(stable=True)
        self._add(start)
        return routed[self.order], received.sum(0)

    def combine(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if self.splits is None:
            return output
        start = self._mark()
        sent, got = self.splits
        rank_major = torch.empty_like(output).index_copy_(0, self.order, output)
        back = _exchange(rank_major, sent, got, mesh, self.timer)
        self.splits = self.order = None
        self._add(start)
        return back

    def _mark(self) -> Any:
        return self.timer.mark() if self.timer is not None else None

    def _add(self, start: Any) -> None:
        if self.timer is not None:
            self.timer.add(start, self.timer.mark())


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
              mesh: DeviceMesh, timer: Any) -> torch.Tensor:
    """all_to_all_single of `rows` over `mesh` (differentiable), its backward timed."""
    box: list[Any] = []  # the backward's start mark, from the mark after to the one before
    if timer is not None:
        rows = _BackwardMark.apply(rows, timer, box, False)
    out = funcol.wait_tensor(funcol.all_to_all_single(rows, out_splits, in_splits, mesh))
    if timer is not None:
        out = _BackwardMark.apply(out, timer, box, True)
    return out


class _BackwardMark(torch.autograd.Function):
    """Identity; in backward, a mark on `timer`: the one after an all-to-all (`opens`)
    runs first and keeps its mark in `box`, the one before it closes the span."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, timer: Any, box: list[Any], opens: bool
                ) -> torch.Tensor:
        ctx.timer, ctx.box, ctx.opens = timer, box, opens
        return x.detach()  # the same storage, not a view: FSDP's output hooks hold

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.opens:
            ctx.box.append(ctx.timer.mark())
        elif ctx.box:
            ctx.timer.add(ctx.box.pop(), ctx.timer.mark())
        return grad, None, None, None
