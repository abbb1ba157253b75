"""The MoE family's parallel side, beside its model: the tensor-parallel plan and the
pipeline stages.

Tensor parallelism: attention as the GPT's (q/k/v column-wise, whole heads a rank; the
output row-wise; the per-head q/k norms see their rank's heads, their weights replicated
with the gradient reduced: SequenceParallel over the heads dim), the leading dense
layers' FFN and the shared experts as the GPT's MLP (gate and up column-wise, down
row-wise). The routed experts and the router are left whole on every tp rank for now: the
MoE layer takes the whole sequence (gathered under sequence parallelism) and hands back
its rank's slice, so every tp rank routes and computes the same tokens (duplicated work,
no collective inside the layer). Expert parallelism (parallel.ep) is what shards them: an
ExpertParallel style (models.moe.expert_parallel) over each `moe.experts`, the
GroupedExperts module (`moe_ep_plan`), on the ep mesh; the router stays whole.

Pipeline stages: the GPT's split (models.stage_split: the embeddings and the head weigh a
layer each), each stage keeping the whole model's parameter names; a stage before the last
returns (activations, the balancing loss so far), which the next takes.
"""

from __future__ import annotations

import copy

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from trainwise.models.moe.expert_parallel import ExpertParallel
from trainwise.models.moe.layers import GroupedExperts
from trainwise.models.moe.model import MoEModel
from trainwise.models.stage_split import stage_range


def _feed_forward(prefix: str, output: object) -> dict[str, ParallelStyle]:
    """A SwiGLU (gate, up, down) split as the GPT's MLP, its output laid out as `output`."""
    return {
        f"{prefix}.gate": ColwiseParallel(),
        f"{prefix}.up": ColwiseParallel(),
        f"{prefix}.down": RowwiseParallel(output_layouts=output),
    }


def moe_tp_plan(model: MoEModel, sequence_parallel: bool) -> list[dict[str, ParallelStyle]]:
    """The MoE model's tensor-parallel plan over a 1-D tp mesh, or a pipeline stage's (the
    plan of the modules it holds)."""
    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()  # the residual stream between blocks
    plan: dict[str, ParallelStyle] = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    names = list(model.blocks.keys()) if isinstance(model.blocks, nn.ModuleDict) else [
        str(i) for i in range(len(model.blocks))
    ]
    gather = dict(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
    for block, i in zip(model.layers(), names, strict=True):
        b = f"blocks.{i}"
        plan[f"{b}.attn"] = PrepareModuleInput(**gather, use_local_output=True)
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{b}.attn.{name}"] = ColwiseParallel()
        plan[f"{b}.attn.out_proj"] = RowwiseParallel(output_layouts=stream)
        if block.attn.q_norm is not None:  # over [B, T, heads, head_dim]: this rank's heads
            plan[f"{b}.attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan[f"{b}.attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        if block.moe is None:
            plan[f"{b}.mlp"] = PrepareModuleInput(**gather, use_local_output=True)
            plan.update(_feed_forward(f"{b}.mlp", stream))
        else:
            # The whole sequence in, this rank's slice of it out (the balancing loss as is).
            plan[f"{b}.moe"] = PrepareModuleInputOutput(
                **gather, use_local_input=True, output_layouts=(Replicate(), None),
                desired_output_layouts=(stream, None), use_local_output=True,
            )
            if block.moe.shared is not None:  # its output summed with the replicated experts'
                plan.update(_feed_forward(f"{b}.moe.shared", Replicate()))
        if sp:
            plan[f"{b}.norm1"] = SequenceParallel()
            plan[f"{b}.norm2"] = SequenceParallel()
    if model.norm is None:  # a pipeline stage before the last: no head
        return [plan]
    if sp:
        plan["norm"] = SequenceParallel()
    head: dict[str, ParallelStyle] = {}
    if model.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(
            input_layouts=stream, output_layouts=Shard(-1), use_local_output=False
        )
    else:  # tied: F.linear with the row-split embedding, as the GPT's
        head["norm"] = PrepareModuleOutput(
            output_layouts=stream, desired_output_layouts=Replicate(), use_local_output=False
        )
    return [plan, head] if head else [plan]


def moe_ep_plan(model: nn.Module, timer: object = None) -> dict[str, ParallelStyle]:
    """The expert-parallel plan of a MoE model or a pipeline stage of one: an
    ExpertParallel style over every routed experts module it holds (`timer`: where the
    all-to-alls' spans go)."""
    style = ExpertParallel(timer)
    return {name: style for name, m in model.named_modules() if isinstance(m, GroupedExperts)}


def split_moe(model: MoEModel, stage: int, stages: int) -> MoEModel:
    """Stage `stage` of `stages` of `model` (built on the meta device): a MoEModel sharing
    the blocks of its range (and the AuxBox) with `model`, under the whole model's names;
    the embedding on the first stage, the final norm and head on the last, a tied head a
    copy of the embedding there."""
    from trainwise.models.pipeline import _STAGE, StageInfo

    first, last = stage == 0, stage == stages - 1
    part = MoEModel.__new__(MoEModel)
    nn.Module.__init__(part)
    part.__dict__.update({k: v for k, v in vars(model).items() if not k.startswith("_")})
    part._modules.update(model._modules)
    part.blocks = nn.ModuleDict(
        {str(i): model.blocks[i] for i in stage_range(len(model.blocks), stages, stage)}
    )
    part.embeds = first
    if not first:
        tied_head = last and model.lm_head is None
        part.tok_emb = copy.deepcopy(model.tok_emb) if tied_head else None
    if not last:
        part.norm = None
        part.lm_head = None
    ties = {"tok_emb.weight": "tok_emb.weight"} if model.lm_head is None else {}
    part.__dict__[_STAGE] = StageInfo("blocks", ties)
    return part
