"""The MoE family's parallel side, beside its model: the tensor-parallel plan and the
pipeline stages.

Tensor parallelism: attention as the GPT's (q/k/v column-wise, whole heads a rank; the
output row-wise; the per-head q/k norms see their rank's heads, their weights replicated
with the gradient reduced: SequenceParallel over the heads dim), the leading dense
layers' FFN and the shared experts as the GPT's MLP (gate and up column-wise, down
row-wise). The MoE layer splits the tokens over the tp ranks, as Megatron-Core does (and
torchtitan's "ETP 1"): it takes this rank's slice of the sequence (Shard(1): under
sequence parallelism the stream's own shard, no collective; otherwise its slice of the
replicated stream) and each tp rank routes, dispatches and computes 1 / tp of the tokens;
its output is that slice, which DTensor all-gathers where the stream is replicated. The
router and the routed experts are replicas on the tp ranks (`TokenSplit`), their
gradients each rank's tokens' share, summed over tp (layers.local: Partial); the shared
experts gather the sequence and reduce-scatter it back, as the MLP under sequence
parallelism. The balancing loss sums its statistics over the tp ranks (layers.MoE
._balance) and the loads each rank counts sum to the step's (models.moe.balance).
Expert parallelism (parallel.ep) shards the routed experts: an ExpertParallel style
(models.moe.expert_parallel) over each `moe.experts`, the GroupedExperts module
(`moe_ep_plan`), on the ep mesh, whose groups are borrowed from the data- and
tensor-parallel ranks together (ParallelDims.expert_dims): the tokens of a tp group's
ranks are different tokens, as those of data-parallel ranks.

Pipeline stages: the GPT's split (models.pipeline.split_blocks; models.stage_split: the
embeddings and the head weigh a layer each), each stage keeping the whole model's
parameter names; a stage before the last returns (activations, the balancing loss so
far), which the next takes.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from trainwise.models.gpt_parallel import block_names, with_head
from trainwise.models.moe.expert_parallel import ExpertParallel
from trainwise.models.moe.layers import GroupedExperts
from trainwise.models.moe.model import MoEModel


def _feed_forward(prefix: str, output: object) -> dict[str, ParallelStyle]:
    """A SwiGLU (gate, up, down) split as the GPT's MLP, its output laid out as `output`."""
    return {
        f"{prefix}.gate": ColwiseParallel(),
        f"{prefix}.up": ColwiseParallel(),
        f"{prefix}.down": RowwiseParallel(output_layouts=output),
    }


class TokenSplit(ParallelStyle):
    """The tp split of a MoE layer's tokens: this rank's slice of the sequence in
    (Shard(1) of the stream), the layer's output (that slice) laid out as the stream, the
    router's and routed experts' parameters replicated over tp (their gradients Partial:
    layers.local), and the tp mesh given to the layer for its balancing loss."""

    def __init__(self, stream: object):
        super().__init__()
        self.io = PrepareModuleInputOutput(
            input_layouts=(stream,), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1), None), desired_output_layouts=(stream, None),
            use_local_output=True,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for part in (module.router, module.experts):
            for sub in part.modules():
                _replicate_params(sub, device_mesh)
        module.token_split = device_mesh
        return self.io._apply(module, device_mesh)


def _replicate_params(module: nn.Module, mesh: DeviceMesh) -> None:
    """Each parameter a Replicate DTensor of the (equal) local one, buffers left as they
    are (the router's bias moves on every rank alike)."""
    for key, param in list(module.named_parameters(recurse=False)):
        dt = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
        module.register_parameter(key, nn.Parameter(dt, param.requires_grad))


def moe_tp_plan(model: MoEModel, sequence_parallel: bool) -> list[dict[str, ParallelStyle]]:
    """The MoE model's tensor-parallel plan over a 1-D tp mesh, or a pipeline stage's (the
    plan of the modules it holds)."""
    sp = sequence_parallel
    stream = Shard(1) if sp else Replicate()  # the residual stream between blocks
    plan: dict[str, ParallelStyle] = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    names = block_names(model)
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
            # This rank's slice of the tokens in and out (TokenSplit).
            plan[f"{b}.moe"] = TokenSplit(stream)
            if block.moe.shared is not None:  # the sequence gathered, its slice back
                plan[f"{b}.moe.shared"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                )
                plan.update(_feed_forward(f"{b}.moe.shared", Shard(1)))
        if sp:
            plan[f"{b}.norm1"] = SequenceParallel()
            plan[f"{b}.norm2"] = SequenceParallel()
    return with_head(model, plan, sp, stream)  # as the GPT's


def moe_ep_plan(model: nn.Module, timer: object = None) -> dict[str, ParallelStyle]:
    """The expert-parallel plan of a MoE model or a pipeline stage of one: an
    ExpertParallel style over every routed experts module it holds (`timer`: where the
    all-to-alls' spans go)."""
    style = ExpertParallel(timer)
    return {name: style for name, m in model.named_modules() if isinstance(m, GroupedExperts)}
