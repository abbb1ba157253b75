"""The built-in GPT's parallel side, beside the model (as torchtitan keeps a
`parallelize.py` per model): its tensor-parallel plan.

The tensor-parallel plan is Megatron's: q/k/v and the MLP's up/gate projections split
column-wise (each rank holds whole heads and a slice of the FFN width), the attention output
and the MLP's down projection row-wise (one all-reduce, or reduce-scatter, per pair); the
token embedding is split by vocabulary rows and the output layer by vocabulary columns, so
the logits stay sharded and the loss is computed on the shards (`loss_parallel`). With
sequence parallelism the norms and the residual stream between blocks hold a slice of the
sequence instead of a replica.

The runtime reads two hooks of any model (`run.parallelize`): `tp_plan(sequence_parallel)`
returns the plan (a list of `parallelize_module` plans, applied in order), and
`init_parameter(name, tensor, generator)` fills one parameter at full size, so that a model
built on the meta device can be initialised shard by shard with the values of a single
process (the GPT's is `GPT.init_parameter`, beside its `init_weights`). The registry hands
both to the runtime with the GPT (`ModelBundle`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from trainwise.models.gpt import GPT


def gpt_tp_plan(model: GPT, sequence_parallel: bool) -> list[dict[str, ParallelStyle]]:
    """The GPT's tensor-parallel plan over a 1-D tp mesh (module names as in the model), or
    a pipeline stage's: the plan of the modules it holds."""
    sp = sequence_parallel
    # Between blocks the residual stream is a slice of the sequence (sp) or a replica.
    stream = Shard(1) if sp else Replicate()
    learned_pos = model.pos_emb is not None
    names = block_names(model)
    plan: dict[str, ParallelStyle] = {}
    if model.tok_emb is not None:  # the embedding, or a last stage's copy of a tied head
        # Position embeddings are added to the whole sequence, so with them the token
        # embedding ends replicated and block 0 takes its slice of the sequence.
        plan["tok_emb"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate() if learned_pos else stream
        )
    if sp and learned_pos and model.embeds and "0" in names:
        plan["blocks.0"] = PrepareModuleInput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Shard(1),),
            use_local_output=True,
        )
    for block, i in zip(model.layers(), names, strict=True):
        b = f"blocks.{i}"
        for part, outputs in (("attn", ("out_proj",)), ("mlp", ("down",))):
            plan[f"{b}.{part}"] = PrepareModuleInput(
                input_layouts=(stream,),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,
            )
            plan[f"{b}.{part}.{outputs[0]}"] = RowwiseParallel(output_layouts=stream)
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.up"):
            plan[f"{b}.{name}"] = ColwiseParallel()
        if block.mlp.gate is not None:
            plan[f"{b}.mlp.gate"] = ColwiseParallel()
        if sp:
            plan[f"{b}.norm1"] = SequenceParallel()
            plan[f"{b}.norm2"] = SequenceParallel()
    return with_head(model, plan, sp, stream)


def block_names(model: nn.Module) -> list[str]:
    """The names of `model.blocks` (a pipeline stage's ModuleDict keeps the whole model's)."""
    if isinstance(model.blocks, nn.ModuleDict):
        return list(model.blocks.keys())
    return [str(i) for i in range(len(model.blocks))]


def with_head(
    model: nn.Module, plan: dict[str, ParallelStyle], sp: bool, stream: Shard | Replicate
) -> list[dict[str, ParallelStyle]]:
    """A blocks model's plan (the GPT's, the MoE family's) completed with its final norm
    and output layer, whose logits stay sharded by vocabulary (a DTensor, for
    loss_parallel); a pipeline stage before the last holds neither."""
    if model.norm is None:
        return [plan]
    if sp:
        plan["norm"] = SequenceParallel()
    if model.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(
            input_layouts=stream, output_layouts=Shard(-1), use_local_output=False
        )
        return [plan]
    # Tied: the head is F.linear with the row-split embedding, which DTensor computes
    # column-parallel once the final norm hands it a replicated DTensor.
    head = {"norm": PrepareModuleOutput(
        output_layouts=stream, desired_output_layouts=Replicate(), use_local_output=False
    )}
    return [plan, head]
