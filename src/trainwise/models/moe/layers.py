"""The Mixture-of-Experts feed-forward: a token-choice top-k router, the routed experts as
one module with 3-D weights, optional shared experts, and the load-balancing loss.

The layer runs in three parts, as torchtitan's does, so that expert parallelism can swap
the middle one without touching the model: the router picks each token's K experts; the
tokens are *dispatched* (their K copies sorted by expert, with the count each expert got:
`num_tokens_per_expert`); `GroupedExperts.forward(tokens, num_tokens_per_expert)` runs
every expert on its contiguous run of rows; the rows are *combined* back (unsorted,
weighted by their scores, summed over the K). An ExpertParallel style wraps
`GroupedExperts` and replaces dispatch and combine by all_to_all_single; the experts'
weights are [E, ...] tensors it can shard on dim 0.

Nothing here has a shape that depends on the routing (the K copies of T tokens are T x K
rows, the counts an [E] vector): the layer runs on the meta device and on fake tensors
(the planner's profile, the doctor's simulation) as it runs on real ones. Only the
per-expert loop (the CPU fallback of the grouped GEMM) reads the counts on the host.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Partial

from trainwise.models.gpt import bare
from trainwise.models.moe.shapes import MoEShape

KERNELS = ("auto", "grouped", "loop")


def in_backward() -> bool:
    """Whether autograd's engine is running (activation checkpointing recomputes a block's
    forward inside backward, which must not count its tokens again)."""
    return torch._C._current_graph_task_id() != -1


_NOT_COUNTED = [0]  # passes of the engine that train nothing in progress (not_counted)


def not_counted(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, during which the routers count no tokens: a pass that trains nothing but
    runs the model forward and backward (torch's pipeline metadata inference, on made-up
    inputs). The engine wraps such passes; the model has no way to tell them apart."""

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _NOT_COUNTED[0] += 1
        try:
            return method(*args, **kwargs)
        finally:
            _NOT_COUNTED[0] -= 1

    return wrapped


class SwiGLU(nn.Module):
    """A dense SwiGLU feed-forward, named as the GPT's MLP (gate, up, down): the shared
    experts, and the leading dense layers' FFN."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate = bare(nn.Linear, d_model, d_ff, bias=False)
        self.up = bare(nn.Linear, d_model, d_ff, bias=False)
        self.down = bare(nn.Linear, d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Router(nn.Module):
    """Token-choice top-k routing: scores over the experts (softmax or sigmoid, in fp32),
    each token's K best by score plus the balancing bias (the bias picks, it never weighs:
    DeepSeek-V3's auxiliary-loss-free balancing), the K scores renormalised to sum to 1
    where the shape says, times route_scale. With a capacity factor, a token's copies
    beyond its expert's capacity (in token order) get weight 0."""

    def __init__(self, shape: MoEShape, capacity_factor: float | None = None):
        super().__init__()
        m = shape.moe
        self.experts, self.top_k = m.experts, m.top_k
        self.score, self.renormalize, self.route_scale = m.score, m.renormalize, m.route_scale
        self.capacity_factor = capacity_factor
        self.gate = bare(nn.Linear, shape.d_model, m.experts, bias=False)
        # Checkpointed (a resume continues the balancing); equal on every rank.
        self.register_buffer("expert_bias", torch.empty(m.experts, dtype=torch.float32))
        self.reset_buffers()
        # Tokens each expert got since the last bias update: a plain attribute, not a
        # buffer, so that DDP's buffer broadcast does not overwrite a rank's own count.
        self.load: torch.Tensor | None = None

    @torch.no_grad()
    def reset_buffers(self) -> None:
        self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, d] -> (weights [N, K], experts [N, K], scores [N, E] in fp32)."""
        kind = x.device.type
        off = contextlib.nullcontext() if kind == "meta" else torch.autocast(kind, enabled=False)
        with off:  # routing stays in fp32
            logits = F.linear(x.float(), local(self.gate.weight).float())
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        chosen = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.route_scale
        if self.capacity_factor is not None:
            weights = weights * self._kept(chosen)
        return weights, chosen, scores

    def _kept(self, chosen: torch.Tensor) -> torch.Tensor:
        """1 for each (token, k) within its expert's capacity, 0 beyond (token order)."""
        flat = chosen.reshape(-1)
        capacity = math.ceil(self.capacity_factor * flat.numel() / self.experts)
        order = flat.argsort(stable=True)
        counts = per_expert(flat, self.experts)
        starts = counts.cumsum(0) - counts
        rank = torch.empty_like(order)
        rank[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        return (rank < capacity).to(torch.float32).view_as(chosen)

    def count_on_backward(self, out: torch.Tensor, counts: torch.Tensor) -> None:
        """Add a training forward's tokens per expert to the load since the last bias
        update when its backward reaches `out` with a gradient that is not all zero: a
        pass whose loss counts zero (the step's exposed-sync probe repeats a micro-batch
        with its loss x 0) is not counted twice, and no host sync is needed to tell."""
        if out.requires_grad and not in_backward() and not _NOT_COUNTED[0]:
            out.register_hook(lambda grad: self._add_load(counts, grad))

    @torch.no_grad()
    def _add_load(self, counts: torch.Tensor, grad: torch.Tensor) -> None:
        counts = counts.float() * grad.ne(0).any()
        self.load = counts if self.load is None else self.load + counts


def per_expert(flat: torch.Tensor, experts: int) -> torch.Tensor:
    """How many of `flat` (expert ids) each expert got: an [E] vector, a static shape."""
    counts = torch.zeros(experts, dtype=torch.long, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class GroupedExperts(nn.Module):
    """The routed experts, E SwiGLUs as three [E, out, in] weights (expert e's gate, up and
    down are `gate_proj[e]`, `up_proj[e]`, `down_proj[e]`, laid out as nn.Linear weights).
    forward(rows, num_tokens_per_expert): the rows sorted by expert, each expert's a
    contiguous run of the counted length."""

    def __init__(self, experts: int, d_model: int, d_expert: int):
        super().__init__()
        self.experts = experts
        self.gate_proj = nn.Parameter(torch.empty(experts, d_expert, d_model))
        self.up_proj = nn.Parameter(torch.empty(experts, d_expert, d_model))
        self.down_proj = nn.Parameter(torch.empty(experts, d_model, d_expert))
        self.kernel = "auto"  # KERNELS: "grouped" / "loop" force one (tests compare them)

    def forward(self, rows: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        weights = [local(w) for w in (self.gate_proj, self.up_proj, self.down_proj)]
        kernel = self.kernel if self.kernel != "auto" else _kernel(rows, weights[0])
        if is_fake(rows) or rows.device.type == "meta":
            return _padded(rows, *weights)  # no counts to read: the same work in even runs
        # No rows at all: the loop, whose empty GEMMs cost nothing (torch._grouped_mm's
        # backward fails on zero rows, on the CPU at least).
        if kernel == "grouped" and rows.shape[0]:
            return _grouped(rows, num_tokens_per_expert, *weights)
        return _loop(rows, num_tokens_per_expert, *weights)


def local(weight: torch.Tensor) -> torch.Tensor:
    """A weight's part on this rank: expert parallelism's shard (its experts), or, under
    tensor parallelism's token split (models.moe.parallel), a replica whose gradient is
    this rank's tokens' share: Partial, which DTensor (or FSDP2) sums over the tp ranks."""
    if not isinstance(weight, DTensor):
        return weight
    grads = [Partial() if p.is_replicate() else p for p in weight.placements]
    return weight.to_local(grad_placements=grads)


def _kernel(rows: torch.Tensor, weight: torch.Tensor) -> str:
    """torch._grouped_mm where it exists and applies (CUDA, bf16, rows of 16-byte
    multiples), else the per-expert loop."""
    dtype = _compute_dtype(rows)
    aligned = all(n % 8 == 0 for n in weight.shape[1:])
    usable = hasattr(torch, "_grouped_mm") and rows.is_cuda and dtype == torch.bfloat16
    return "grouped" if usable and aligned else "loop"


def _compute_dtype(rows: torch.Tensor) -> torch.dtype:
    """The dtype the experts' GEMMs run in: autocast's where it is on, else the rows'."""
    kind = rows.device.type
    if kind == "meta" or not torch.is_autocast_enabled(kind):
        return rows.dtype
    return torch.get_autocast_dtype(kind)


def _grouped(rows, counts, gate, up, down) -> torch.Tensor:
    """Each projection one grouped GEMM over all experts (offsets: the runs' ends)."""
    dtype = _compute_dtype(rows)
    offsets = counts.cumsum(0).to(torch.int32)
    x = rows.to(dtype)

    def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, w.to(dtype).transpose(-2, -1), offs=offsets)

    return mm(F.silu(mm(x, gate)) * mm(x, up), down)


def _loop(rows, counts, gate, up, down) -> torch.Tensor:
    """One expert at a time on its run of rows (the counts read on the host). An expert
    without rows runs too, on none: the output stays a function of the rows and the
    weights whatever the routing. Under expert parallelism a rank whose experts got no
    token still joins the combine's all-to-all in backward (autograd skips a node whose
    input needs no gradient, and its peers would wait for it for ever), and its weights
    get a zero gradient, not none (FSDP reduce-scatters the same tensors on every rank)."""
    return torch.cat([
        F.linear(F.silu(F.linear(x, gate[e])) * F.linear(x, up[e]), down[e])
        for e, x in enumerate(rows.split(counts.tolist()))
    ])


def _padded(rows, gate, up, down) -> torch.Tensor:
    """On tensors without values: the rows in E even runs (padded), one batched GEMM per
    projection: the grouped GEMM's FLOPs and activations, with shapes that are known."""
    n, experts = rows.shape[0], gate.shape[0]
    per = -(-n // experts)
    x = F.pad(rows, (0, 0, 0, per * experts - n)).view(experts, per, -1)
    dtype = _compute_dtype(rows)
    x = x.to(dtype)
    h = F.silu(x @ gate.to(dtype).transpose(1, 2)) * (x @ up.to(dtype).transpose(1, 2))
    return (h @ down.to(dtype).transpose(1, 2)).reshape(per * experts, -1)[:n]


class MoE(nn.Module):
    """The MoE feed-forward of one layer: forward(x [B, T, d]) -> (y [B, T, d], aux [B]),
    aux the load-balancing loss of each sequence (None unless training with `aux_loss`)."""

    def __init__(self, shape: MoEShape, capacity_factor: float | None = None,
                 aux_loss: bool = True):
        super().__init__()
        m = shape.moe
        self.router = Router(shape, capacity_factor)
        self.experts = GroupedExperts(m.experts, shape.d_model, m.d_expert)
        self.shared = SwiGLU(shape.d_model, m.shared_width) if m.shared_experts else None
        self.aux_loss = aux_loss
        # Under tensor parallelism, the tp mesh over which the tokens are split (each rank
        # routes its share: models.moe.parallel); the balancing loss sums its statistics
        # over it.
        self.token_split: Any = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        weights, chosen, scores = self.router(tokens)
        flat = chosen.reshape(-1)
        counts = per_expert(flat, self.router.experts)
        # Dispatch: the token of each of the T x K copies, sorted by expert (stable: in
        # token order within an expert, which capacity counts in).
        order = flat.argsort(stable=True)
        routed = self.experts(tokens[order // self.router.top_k], counts)
        # Combine: back in (token, k) order, weighted, summed over the K.
        unsorted = torch.empty_like(routed).index_copy_(0, order, routed)
        out = (unsorted.view(b * t, -1, d) * weights.unsqueeze(-1).to(routed.dtype)).sum(1)
        out = out.to(x.dtype).view(b, t, d)
        if self.shared is not None:  # on [B, T, d]: its tp plan gathers the sequence
            out = out + self.shared(x)
        if self.training:
            self.router.count_on_backward(out, counts)
        aux = self._balance(scores, chosen, b) if self.training and self.aux_loss else None
        return out, aux

    def _balance(self, scores: torch.Tensor, chosen: torch.Tensor, b: int) -> torch.Tensor:
        """Each sequence's load-balancing loss: E / (K T) x sum over experts of the tokens
        routed to it x its mean score (scores normalised to sum to 1 a token, as DeepSeek-
        V3's sequence-wise loss takes sigmoid scores): 1 when balanced. Per sequence, so a
        step's loss does not depend on how its sequences are split among ranks and
        micro-batches. Under the tp token split each rank holds a slice of every sequence:
        the sums over it are summed over the tp ranks (Partial -> Replicate, whose backward
        hands each rank the whole gradient of its slice), so every rank has the loss of
        the whole sequences."""
        e = self.router.experts
        probs = scores if self.router.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        mean_score = probs.view(b, -1, e).mean(1)  # [B, E]
        picks = chosen.reshape(b, -1)  # [B, T x K]
        routed = torch.zeros(b, e, device=picks.device).scatter_add_(
            1, picks, torch.ones_like(picks, dtype=torch.float32))
        share = routed * (e / picks.shape[1])  # E / (K T) x tokens routed
        if self.token_split is not None:  # equal slices: the whole's is their mean
            both = DTensor.from_local(torch.stack([mean_score, share]), self.token_split,
                                      [Partial()], run_check=False).full_tensor()
            mean_score, share = both / self.token_split.size()
        return (share * mean_score).sum(-1)
