"""The Mixture-of-Experts decoder: a Llama-style backbone (the GPT's rope tables and module
names, with a head width of its own and Qwen3's per-head q/k norms) whose feed-forwards
are `layers.MoE` (the leading `moe.dense_layers` a dense SwiGLU), and its loss.

Built on the meta device and initialised parameter by parameter (`init_parameter`), as
the GPT. A block returns (x, aux): its sequences' load-balancing losses (None when not
training). The model sums them over its layers; a pipeline stage before the last hands
the running sum to the next beside the activations, so the last stage holds the whole
model's. The forward that ends in the head leaves that sum in the model's `AuxBox`, which
`MoELoss` empties and adds to the cross entropy: every step strategy then scales and
averages it as the loss itself (1 / grad_accum, a pipeline micro-batch's weight, the
probe's zero, fp16's loss scale), and the loss function says which part of its value it
was (`last_aux`), which the step logs as `aux_loss`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainwise.errors import ModelError
from trainwise.models.gpt import Rotary, bare, bare_embedding, packed_layout
from trainwise.models.moe.layers import MoE, SwiGLU
from trainwise.models.moe.shapes import MoEShape

INIT_STD = 0.02  # the GPT's, and Hugging Face's initializer_range for these families
# Projections that write into the residual stream: scaled down by depth at init.
_RESIDUAL = ("attn.out_proj.weight", "mlp.down.weight", "experts.down_proj", "shared.down.weight")


def _norm(shape: MoEShape, width: int | None = None) -> nn.Module:
    return bare(nn.RMSNorm, width or shape.d_model, eps=shape.norm_eps)


class MoEAttention(nn.Module):
    """Causal self-attention with grouped-query heads (as the GPT's, the same names), heads
    of `head_dim` whatever d_model, and optional RMSNorms over each query and key head
    before rope (Qwen3)."""

    def __init__(self, shape: MoEShape, dropout: float):
        super().__init__()
        hd = shape.head_dim
        self.head_dim, self.groups = hd, shape.n_head // shape.n_kv_head
        q_dim, kv_dim = shape.n_head * hd, shape.n_kv_head * hd
        self.q_proj = bare(nn.Linear, shape.d_model, q_dim, bias=False)
        self.k_proj = bare(nn.Linear, shape.d_model, kv_dim, bias=False)
        self.v_proj = bare(nn.Linear, shape.d_model, kv_dim, bias=False)
        self.out_proj = bare(nn.Linear, q_dim, shape.d_model, bias=False)
        self.q_norm = _norm(shape, hd) if shape.qk_norm else None
        self.k_norm = _norm(shape, hd) if shape.qk_norm else None
        self.rotary = Rotary(hd, shape.max_seq_len, shape.rope_theta)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_head / tp of them.
        q = self.q_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rotary(q.transpose(1, 2), positions)
        k = self.rotary(k.transpose(1, 2), positions)
        if self.groups > 1:
            k = k.repeat_interleave(self.groups, dim=1)
            v = v.repeat_interleave(self.groups, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=attn_mask is None,
        )
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))


class MoEBlock(nn.Module):
    """One pre-norm layer, forward(x) -> (x, aux): attention, then the MoE feed-forward
    (`moe`) or, for a leading dense layer, a SwiGLU (`mlp`)."""

    def __init__(self, shape: MoEShape, index: int, dropout: float = 0.0,
                 capacity_factor: float | None = None, aux_loss: bool = True):
        super().__init__()
        self.norm1, self.attn = _norm(shape), MoEAttention(shape, dropout)
        self.norm2 = _norm(shape)
        if shape.is_moe_layer(index):
            self.moe: MoE | None = MoE(shape, capacity_factor, aux_loss)
            self.mlp: SwiGLU | None = None
        else:
            self.moe, self.mlp = None, SwiGLU(shape.d_model, shape.moe.d_dense)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.drop(self.attn(self.norm1(x), positions=positions, attn_mask=attn_mask))
        h = self.norm2(x)
        if self.moe is None:
            return x + self.drop(self.mlp(h)), None
        y, aux = self.moe(h)
        return x + self.drop(y), aux


class AuxBox:
    """Where the forward that ends in the head leaves its sequences' balancing loss for
    the loss function (one object shared by the model and its pipeline stages)."""

    def __init__(self) -> None:
        self.aux: torch.Tensor | None = None

    def take(self) -> torch.Tensor | None:
        aux, self.aux = self.aux, None
        return aux


class MoEModel(nn.Module):
    """Decoder-only MoE language model: forward(idx [B, T]) -> logits [B, T, vocab].

    A pipeline stage after the first takes (activations, the balancing loss so far) and a
    stage before the last returns them; `doc` (packed examples' ids) is the first stage's
    second argument or any stage's keyword, as for the GPT."""

    def __init__(self, shape: MoEShape, dropout: float = 0.0,
                 capacity_factor: float | None = None, aux_loss: bool = True):
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ModelError(f"model.dropout = {dropout!r}: must be in [0, 1)")
        self.shape = shape
        self.tok_emb = bare_embedding(shape.vocab_size, shape.d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks: nn.ModuleList | nn.ModuleDict = nn.ModuleList(
            MoEBlock(shape, i, dropout, capacity_factor, aux_loss) for i in range(shape.n_layer)
        )
        self.embeds = True  # False on pipeline stages after the first
        self.norm = _norm(shape)
        self.lm_head = (None if shape.tie_embeddings
                        else bare(nn.Linear, shape.d_model, shape.vocab_size, bias=False))
        self.box = AuxBox()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every parameter by init_parameter (from the global RNG) and the computed
        buffers (rope tables, balancing biases); safe on meta and after `to_empty`."""
        for name, param in self.named_parameters():
            if not param.is_meta:  # nothing to draw (normal_'s meta kernel imports dynamo)
                self.init_parameter(name, param)
        for module in self.modules():
            if module is not self and callable(getattr(module, "reset_buffers", None)):
                module.reset_buffers()

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor,
                       generator: torch.Generator | None = None) -> None:
        """Fill parameter `name` (or a full-size tensor standing for it): unit norm
        scales, normal(0.02) weights, the projections into the residual stream scaled
        down by depth (as the GPT's)."""
        owner = name.rsplit(".", 2)[-2]
        if owner.startswith("norm") or owner.endswith("_norm"):
            nn.init.ones_(tensor)
        elif name.endswith(_RESIDUAL):
            std = INIT_STD / math.sqrt(2 * self.shape.n_layer)
            nn.init.normal_(tensor, mean=0.0, std=std, generator=generator)
        else:
            nn.init.normal_(tensor, mean=0.0, std=INIT_STD, generator=generator)

    def layers(self) -> list[nn.Module]:
        """The blocks this model (or pipeline stage) holds, in order."""
        blocks = self.blocks
        return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)

    def forward(self, x: torch.Tensor, *more: torch.Tensor, doc: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.embeds:
            if x.shape[1] > self.shape.max_seq_len:
                raise ModelError(
                    f"input length {x.shape[1]} exceeds the model's max_seq_len = "
                    f"{self.shape.max_seq_len}; shorten the sequence or raise model.seq_len"
                )
            doc = more[0] if more else doc
            aux = x.new_zeros(x.shape[0], dtype=torch.float32)
            h = self.drop(self.tok_emb(x))
        else:  # the previous stage's activations and balancing loss
            h, aux = x, more[0]
        positions, mask = packed_layout(doc) if doc is not None else (None, None)
        for block in self.layers():
            h, layer_aux = block(h, positions=positions, attn_mask=mask)
            if layer_aux is not None:
                aux = aux + layer_aux / self.shape.moe_layers
        if self.norm is None:  # a pipeline stage before the last
            return h, aux
        if self.training:
            self.box.aux = aux
        h = self.norm(h)
        return F.linear(h, self.tok_emb.weight) if self.lm_head is None else self.lm_head(h)


class MoELoss:
    """The training loss of a MoE model: cross entropy plus `coef` x the mean over the
    micro-batch's sequences of their balancing loss (averaged over the MoE layers), which
    the last training forward left in `box`. `last_aux`: that added part of its last
    value (detached; None when none was added), which the step logs."""

    def __init__(self, box: AuxBox, coef: float):
        self.box, self.coef = box, coef
        self.last_aux: torch.Tensor | None = None

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from trainwise.models.registry import cross_entropy_loss

        loss = cross_entropy_loss(output, target)
        aux = self.box.take()
        if aux is None or self.coef == 0:
            self.last_aux = None
            return loss
        if hasattr(loss, "to_local"):  # loss_parallel's replicated DTensor
            loss = loss.to_local()
        part = self.coef * aux.mean()
        self.last_aux = part.detach()
        return loss + part.to(loss.dtype)
