"""Reading a module's structure (on the meta device; nothing runs): its repeated blocks, the
units FSDP and activation checkpointing wrap; the Linear layers whose GEMMs the planner
prices; and, for a decoder-only transformer laid out as trainwise's GPT, its GPTShape.

The blocks, one rule for the runtime and the planner:
1. a `blocks` or `layers` ModuleList / ModuleDict of the root (the built-in models', the
   rule of earlier versions: a user who names them is taken at their word);
2. else the largest run of structurally identical siblings (same class, same parameter
   names and shapes; two or more, each with parameters) anywhere in the tree, largest by
   the parameters it covers, the shallower on a tie: `transformer.h` of a GPT-2, the
   `layers` of a Llama inside a wrapper, the residual stages of a vision model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from trainwise.errors import ModelError
from trainwise.models.shapes import GPTShape, LinearShape

# The attribute names under which a module keeps its repeated blocks, in the order they are
# looked for (nanoGPT-style: `blocks`; torchtitan's models: `layers`): FSDP units, checkpointing
# units and the container pipeline stages are cut along (models.custom.blocks_container).
NAMED_BLOCKS = ("blocks", "layers")
RULE_NAMED = "the model's `{}` list"
RULE_RUN = "the largest run of identical submodules"
# Where decoder code keeps its head counts: trainwise's and nanoGPT's, Meta's Llama,
# PyTorch's and Hugging Face's (on the module or on its `config`).
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "nhead")
KV_HEAD_ATTRS = ("n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads")
THETA_ATTRS = ("rope_theta", "theta", "base")


@dataclass(frozen=True)
class Blocks:
    """A model's repeated blocks, where they are and the rule that found them."""

    modules: tuple[nn.Module, ...]
    path: str  # "layers", "transformer.h"; "" when none
    rule: str  # "" when none


def find_blocks(module: nn.Module) -> Blocks:
    """The repeated blocks of `module` by the rules above (none: an empty Blocks)."""
    for attr in NAMED_BLOCKS:
        units = getattr(module, attr, None)
        if isinstance(units, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) and len(units):
            members = list(units.values() if isinstance(units, nn.ModuleDict) else units)
            return Blocks(tuple(members), blocks_path(module, members) or attr,
                          RULE_NAMED.format(attr))
    best: tuple[int, int, str, list[nn.Module]] | None = None
    for name, parent in module.named_modules(remove_duplicate=True):
        depth = name.count(".") + (1 if name else 0)
        for run in _identical_runs([m for _, m in parent.named_children()]):
            covered = sum(_count(m) for m in run)
            if best is None or (covered, -depth) > (best[0], -best[1]):
                best = (covered, depth, name or "(the root)", run)
    if best is None:
        return Blocks((), "", "")
    return Blocks(tuple(best[3]), best[2], RULE_RUN)


def _identical_runs(children: list[nn.Module]) -> Iterator[list[nn.Module]]:
    """Each run of two or more consecutive `children` of the same structure, with
    parameters."""
    i = 0
    while i < len(children):
        j = i + 1
        key = structure(children[i])
        while j < len(children) and structure(children[j]) == key:
            j += 1
        if j - i >= 2 and key[1]:
            yield children[i:j]
        i = j


def structure(module: nn.Module) -> tuple:
    """What makes two modules the same block: class and parameter names and shapes."""
    return (
        type(module).__qualname__,
        tuple((n, tuple(p.shape)) for n, p in module.named_parameters()),
    )


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def blocks_path(root: nn.Module, blocks: list[nn.Module]) -> str:
    """Where `blocks` (given by a builder) sit in `root`: their container's name."""
    if not blocks:
        return ""
    for name, m in root.named_modules():
        if m is blocks[0]:
            return name.rpartition(".")[0]
    return ""


def linear_shape(module: nn.Module) -> LinearShape | None:
    """(in, out, bias) of an nn.Linear or of transformers' Conv1D (GPT-2's projections,
    a Linear with its weight stored transposed); None for any other module."""
    if isinstance(module, nn.Linear):
        return LinearShape(module.in_features, module.out_features, module.bias is not None)
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        bias = getattr(module, "bias", None) is not None
        return LinearShape(int(module.nx), int(module.nf), bias)
    return None


def linears(module: nn.Module, skip: set[int] | None = None) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every Linear-like layer in `module`, in registration order, minus
    the modules whose ids are in `skip`."""
    skip = skip or set()
    return [
        (n, m) for n, m in module.named_modules()
        if id(m) not in skip and linear_shape(m) is not None
    ]


def infer_gpt_shape(
    root: nn.Module, blocks: list[nn.Module], params: int, seq_len: int | None = None
) -> tuple[GPTShape | None, str]:
    """The GPTShape of `root` when it is laid out as trainwise's GPT (token embedding,
    learned positions or none, blocks of two norms, attention q/k/v/o (or one fused qkv)
    and a GELU or SwiGLU MLP, a final norm, a head tied or not) and its parameter count
    is that shape's; else (None, why not)."""
    if not blocks:
        return None, "no repeated blocks"
    inside = {id(m) for b in blocks for m in b.modules()}
    outer = [(n, m) for n, m in root.named_modules() if id(m) not in inside]
    try:
        shape = _read_gpt(root, blocks[0], len(blocks), outer, seq_len)
    except _NotGPT as why:
        return None, str(why)
    except ModelError as err:  # dimensions GPTShape does not accept
        return None, err.problems[0]
    if shape.num_params() != params:
        return None, (
            f"a GPT of the shape read ({shape.num_params():,} parameters) differs from the "
            f"module ({params:,})"
        )
    return shape, ""


class _NotGPT(Exception):
    """Why a module is not trainwise's GPT structure (a sentence)."""


def _read_gpt(
    root: nn.Module, block: nn.Module, n_layer: int, outer: list, seq_len: int | None
) -> GPTShape:
    embeddings = [m for _, m in outer if isinstance(m, nn.Embedding)]
    if not 1 <= len(embeddings) <= 2:
        raise _NotGPT(f"{len(embeddings)} embeddings outside the blocks, where a GPT has 1 or 2")
    d = embeddings[0].embedding_dim
    norms = [m for m in block.modules() if _norm_kind(m, d)]
    if len(norms) != 2:
        raise _NotGPT(f"{len(norms)} norms of width {d} in a block, where a GPT's has 2")
    attn, mlp_in, out, down = _split_block(block, d)
    q_dim = out.in_features
    if len(attn) == 1:  # one fused projection: q, then k and v
        kv_dim, rem = divmod(attn[0].out_features - q_dim, 2)
        if rem or kv_dim <= 0:
            raise _NotGPT(f"a fused projection of {attn[0].out_features} is not q + 2 kv")
    elif attn[0].out_features == q_dim and attn[1] == attn[2]:
        kv_dim = attn[1].out_features
    else:
        raise _NotGPT("the attention is not q, k, v and an output projection")
    if q_dim != d:
        raise _NotGPT(f"the attention's width {q_dim} is not the model's {d}")
    biases = {s.bias for s in (*attn, *mlp_in, out, down)}
    if len(biases) != 1:
        raise _NotGPT("some projections have biases and others not")
    bias = biases.pop()
    kind = _norm_kind(norms[0], d)
    if _norm_kind(norms[1], d) != kind or (kind == "layernorm") and (
        (norms[0].bias is not None) != bias
    ):
        raise _NotGPT("the norms differ from each other or from the projections' biases")
    n_head, n_kv = _heads(root, block, q_dim, kv_dim)
    vocab, tied, positions = _embeddings(embeddings, outer, d)
    return GPTShape(
        n_layer=n_layer, d_model=d, n_head=n_head, n_kv_head=n_kv, d_ff=down.in_features,
        vocab_size=vocab, max_seq_len=positions or seq_len or 2048, norm=kind,
        mlp="swiglu" if len(mlp_in) == 2 else "gelu", pos="learned" if positions else "rope",
        tie_embeddings=tied, bias=bias, rope_theta=float(_attr(root, block, THETA_ATTRS) or 1e4),
        norm_eps=float(getattr(norms[0], "eps", None) or 1e-5),
    )


def _split_block(block: nn.Module, d: int) -> tuple[list, list, LinearShape, LinearShape]:
    """(the attention's input projections, the MLP's, the attention's output projection,
    the MLP's down projection): the block's projections held by two submodules, the
    attention's first (q, k, v and o, or a fused qkv and o) and the MLP's (up and down,
    or SwiGLU's gate, up and down)."""
    holders: dict[int, list[LinearShape]] = {}
    for name, layer in linears(block):
        holder = id(block.get_submodule(name.rpartition(".")[0]))
        holders.setdefault(holder, []).append(linear_shape(layer))
    if len(holders) != 2:
        raise _NotGPT(f"the block's projections sit in {len(holders)} modules, not in an "
                      "attention and an MLP")
    attn, mlp = holders.values()
    if attn[-1].out_features != d or len(attn) not in (2, 4):
        raise _NotGPT("the attention is not q, k, v (or one fused qkv) and an output projection")
    downs = [s for s in mlp if s.out_features == d]
    ups = [s for s in mlp if s.in_features == d and s.out_features != d]
    if len(downs) != 1 or len(ups) not in (1, 2) or len(ups) + 1 != len(mlp):
        raise _NotGPT("the MLP is neither up and down projections (GELU) nor gate, up and "
                      "down (SwiGLU)")
    if len(ups) == 2 and ups[0] != ups[1]:
        raise _NotGPT("the SwiGLU gate and up projections differ")
    if any(s.out_features != downs[0].in_features for s in ups):
        raise _NotGPT("the MLP's projections do not meet in one width")
    return attn[:-1], ups, attn[-1], downs[0]


def _norm_kind(m: nn.Module, d: int) -> str | None:
    """"layernorm" / "rmsnorm" for a norm of width d (any class named *RMSNorm with one
    weight of d counts as RMSNorm: Llama's, T5's), else None."""
    if isinstance(m, nn.LayerNorm) and tuple(m.normalized_shape) == (d,):
        return "layernorm"
    if isinstance(m, nn.RMSNorm) or type(m).__name__.endswith("RMSNorm"):
        shapes = [tuple(p.shape) for p in m.parameters(recurse=False)]
        return "rmsnorm" if shapes == [(d,)] else None
    return None


def _heads(root: nn.Module, block: nn.Module, q_dim: int, kv_dim: int) -> tuple[int, int]:
    n_head = _attr(root, block, HEAD_ATTRS)
    if not n_head or q_dim % n_head:
        raise _NotGPT(
            "no head count found: an attribute " + " / ".join(HEAD_ATTRS[:3]) + " on the "
            "attention, or num_attention_heads on the model's config"
        )
    head_dim = q_dim // n_head
    n_kv = _attr(root, block, KV_HEAD_ATTRS) or n_head * kv_dim // q_dim
    if n_kv * head_dim != kv_dim:
        raise _NotGPT(f"{n_kv} key/value heads of {head_dim} are not the projection's {kv_dim}")
    return int(n_head), int(n_kv)


def _attr(root: nn.Module, block: nn.Module, names: tuple[str, ...]):
    """The first of `names` found on a module of the block, the block, the root, or their
    `config` (transformers keeps the counts there)."""
    holders = [*block.modules(), root]
    holders += [h.config for h in holders if hasattr(h, "config")]
    for holder in holders:
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _embeddings(embeddings: list, outer: list, d: int) -> tuple[int, bool, int | None]:
    """(vocabulary, tied, learned positions or None): the token embedding is the one the
    head projects back to (the first without a head), the other one positions."""
    heads = [m for _, m in outer if linear_shape(m) is not None]
    if len(heads) > 1:
        raise _NotGPT(
            f"{len(heads)} linear layers outside the blocks, where a GPT has its head alone"
        )
    if heads:
        head = linear_shape(heads[0])
        if head.in_features != d or head.bias:
            raise _NotGPT("the layer outside the blocks is not a head without bias")
        tokens = [e for e in embeddings if e.num_embeddings == head.out_features]
        if not tokens:
            raise _NotGPT("the head's outputs match no embedding's vocabulary")
        token = tokens[0]
        tied = heads[0].weight is token.weight
    else:
        token, tied = embeddings[0], True
    others = [e for e in embeddings if e is not token]
    if any(e.embedding_dim != d for e in others):
        raise _NotGPT("the embeddings differ in width")
    return token.num_embeddings, tied, others[0].num_embeddings if others else None
