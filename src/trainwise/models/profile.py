"""Your own model as the planner sees it: `profile_model` builds it on the meta device
(nothing allocated), reads its parameters, its repeated blocks (models.blocks: the units
the runtime wraps) and their Linear shapes, and its GPTShape when it is laid out as
trainwise's GPT; for any other module, one micro-batch of a sample input runs forward and
backward on fake tensors (PyTorch's FakeTensorMode: shapes, no values) under PyTorch's
memory tracker, FLOP counter and dispatcher, which measure what no formula knows of an
arbitrary module: its activations, the FLOPs of its matmuls outside the Linears and the
work of its other operations.

The sample: a module with a token embedding outside its blocks takes token ids
[micro_batch, seq_len] (a token is a position of the sequence); any other needs a sample
batch (x, y) as its data gives it (a token is then one sample). Without one the profile
says that activations are not counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainwise.dtypes import TORCH_DTYPES
from trainwise.errors import ModelError
from trainwise.models.blocks import (
    RULE_RUN,
    blocks_path,
    find_blocks,
    infer_gpt_shape,
    linear_shape,
    linears,
    structure,
)
from trainwise.models.custom import call_factory, factory_name
from trainwise.models.registry import ModelBundle, ModelSpec, build_model, cross_entropy_loss
from trainwise.models.shapes import LinearShape, ModelProfile, SampleRun
from trainwise.objects import first_line

# A module that takes token ids and no seq_len was given: its learned positions', else this.
DEFAULT_SEQ_LEN = 1024
Sample = tuple[torch.Tensor, torch.Tensor]


def profile_model(
    model: str | ModelSpec | Callable[..., Any],
    kwargs: dict[str, Any] | None = None,
    *,
    vocab_size: int | None = None,
    seq_len: int | None = None,
    sample: Sample | Callable[[], Sample] | None = None,
    precision: str = "fp32",
    ac: str = "none",
    micro_batch: int = 1,
) -> ModelProfile:
    """The profile of `model`: an import path "pkg.mod:factory", "hf:DIR", a preset name
    (or the runtime's ModelSpec of one), or a Python callable returning an nn.Module (or
    (module, loss_fn)), called with `kwargs` under torch.device("meta").

    `vocab_size` / `seq_len`: the job's (a token-id model's input); `sample`: one batch
    (x, y) of the data, or a function returning it (called only for a module that takes
    no token ids); `precision`, `ac`, `micro_batch`: the job's, at which a module without
    a GPT shape is measured. A factory that raises or returns no module: ModelError, one
    line naming it."""
    source, build = _builder(model, kwargs, vocab_size, seq_len)
    with torch.device("meta"):
        bundle = build()
    module = bundle.module
    params = _count(module.parameters())
    trainable = _count(p for p in module.parameters() if p.requires_grad)
    blocks, path, rule, notes = _blocks(module, bundle.blocks, params)
    shape, why = bundle.shape, ""
    if shape is None:
        shape, why = infer_gpt_shape(module, blocks, params, seq_len)
        if shape is not None:
            notes.append(f"priced as trainwise's GPT of the shape read from the module: "
                         f"{_describe(shape)}")
    inside = {id(m) for b in blocks for m in b.modules()}
    # Blocks alike (the rule's runs; a named list may differ): one block's layers stand
    # for all; else each block's layers are counted where they are, once.
    alike = bool(blocks) and all(structure(b) == structure(blocks[0]) for b in blocks)
    block_layers = _within(module, blocks[0]) if alike else []
    outer_layers = linears(module, inside if alike else set())
    # A MoE model's shape gives its sample's vocabulary and sequence, as a GPT's does.
    sized = shape if shape is not None else bundle.moe
    make, tokens, where = _sample(module, inside, sized, vocab_size, seq_len, sample)
    run, rows = None, {}
    if shape is None:
        notes.append(f"priced by its Linear layers' GEMMs and a sample run on fake tensors, not "
                     f"as a GPT ({why})")
        if tokens == 1:
            notes.append("a token is one sample (the module takes no token ids): tokens/s "
                         "read as samples/s")
        if make is None:
            notes.append(f"activations are not counted: {where}")
        else:
            run, rows, failed = _measured(build, make, tokens, precision, ac, micro_batch)
            if failed:
                notes.append(f"activations are not counted: {failed}")
    return ModelProfile(
        source=source, params=params, trainable=trainable, blocks=len(blocks),
        block_params=max((_count(b.parameters()) for b in blocks), default=0),
        in_blocks=_count({id(p): p for b in blocks for p in b.parameters()}.values()),
        block_path=path, block_rule=rule,
        block_linears=_shapes(block_layers, rows), outer_linears=_shapes(outer_layers, rows),
        param_tensors=len(list(module.parameters())), tokens=tokens, shape=shape, run=run,
        tp_plan=bundle.tp_plan is not None, stages=_is_gpt(module), notes=tuple(notes),
        rebuild=build, sample=make,
    )


def _builder(
    model: Any, kwargs: dict[str, Any] | None, vocab: int | None, seq: int | None
) -> tuple[str, Callable[[], ModelBundle]]:
    """(the model's name in messages, a function building its bundle on the current
    device): the registry's for a name, the factory's for a callable."""
    if isinstance(model, ModelSpec):
        return model.name, lambda: build_model(model)
    if isinstance(model, str):
        spec = ModelSpec(name=model, vocab_size=vocab, seq_len=seq, kwargs=dict(kwargs or {}))
        return model, lambda: build_model(spec)
    if not callable(model):
        raise ModelError(
            f"model = {model!r}: not a model; give a preset name, 'package.module:factory', "
            "'hf:DIR' or a function that returns an nn.Module"
        )
    name = factory_name(model)

    def build() -> ModelBundle:
        module, loss_fn = call_factory(model, kwargs, f"model = {name}")
        return ModelBundle(
            module, loss_fn or cross_entropy_loss, list(find_blocks(module).modules), None,
            tp_plan=getattr(module, "tp_plan", None),
        )

    return name, build


def _blocks(
    module: nn.Module, blocks: list[nn.Module], params: int
) -> tuple[list[nn.Module], str, str, list[str]]:
    """(the blocks, where, by which rule, notes): the ones the runtime wraps."""
    if not blocks:
        return [], "", "", [
            "no repeated blocks found (a `blocks` or `layers` list, or a run of identical "
            "submodules): priced from its parameter count as one FSDP unit"
        ]
    found = find_blocks(module)
    if list(found.modules) == list(blocks):
        path, rule = found.path, found.rule
    else:
        path, rule = blocks_path(module, blocks), "the model's builder"
    shared = _count({id(p): p for b in blocks for p in b.parameters()}.values())
    if shared != sum(_count(b.parameters()) for b in blocks):
        return [], "", "", [f"the blocks at {path} share parameters: priced as one FSDP unit"]
    notes = [f"{len(blocks)} blocks ({type(blocks[0]).__name__} at {path}, found as {rule}) "
             "are its FSDP and checkpointing units"]
    if rule == RULE_RUN:
        notes[0] += " (a `blocks` list on the model chooses others)"
    return blocks, path, rule, notes


def _count(params) -> int:
    return sum(p.numel() for p in params)


def _is_gpt(module: nn.Module) -> bool:
    from trainwise.models.gpt import GPT

    return isinstance(module, GPT)


def _describe(shape) -> str:
    return (
        f"{shape.n_layer} layers, width {shape.d_model}, {shape.n_head} heads "
        f"({shape.n_kv_head} key/value), MLP {shape.d_ff} {shape.mlp}, vocabulary "
        f"{shape.vocab_size}, {shape.pos} positions, {shape.norm}"
        + (", tied" if shape.tie_embeddings else "")
    )


def _within(root: nn.Module, part: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name in `root`, layer) of the Linear-like layers of `part`."""
    ids = {id(m) for m in part.modules()}
    return [(n, m) for n, m in linears(root) if id(m) in ids]


def _shapes(
    layers: list[tuple[str, nn.Module]], rows: dict[str, float]
) -> tuple[LinearShape, ...]:
    """The shapes of `layers` with the rows per token a sample measured for each (by
    name; 1 when none ran)."""
    out = []
    for name, layer in layers:
        s = linear_shape(layer)
        assert s is not None
        out.append(LinearShape(s.in_features, s.out_features, s.bias, rows.get(name, 1.0)))
    return tuple(out)


def _sample(
    module: nn.Module, inside: set[int], shape, vocab: int | None, seq: int | None, given: Any
) -> tuple[Callable[[int], Sample] | None, int, str]:
    """(a function making one micro-batch (x, y) of `micro_batch` samples as fakes would
    have them, the tokens of a sample, why there is none)."""
    embeddings = [
        m for m in module.modules() if isinstance(m, nn.Embedding) and id(m) not in inside
    ]
    if embeddings:  # token ids in, the next ids as targets
        vocab = vocab or (shape.vocab_size if shape else embeddings[0].num_embeddings)
        positions = [e.num_embeddings for e in embeddings[1:]]
        own = shape.max_seq_len if shape else (positions or [DEFAULT_SEQ_LEN])[0]
        seq = seq or own

        def ids(micro_batch: int) -> Sample:
            x = torch.randint(0, vocab, (micro_batch, seq))
            return x, torch.randint(0, vocab, (micro_batch, seq))

        return ids, seq, ""
    if given is None:
        return None, 1, (
            "no sample input (a module without a token embedding needs a batch of its data)"
        )
    try:
        x, y = given() if callable(given) else given
    except Exception as exc:  # the data could not give one: said in the plan
        return None, 1, f"no sample batch from the data ({first_line(exc)})"
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        return None, 1, "the sample batch is not (inputs, targets) tensors"

    def like(micro_batch: int) -> Sample:
        return (
            torch.zeros((micro_batch, *x.shape[1:]), dtype=x.dtype),
            torch.zeros((micro_batch, *y.shape[1:]), dtype=y.dtype),
        )

    return like, 1, ""


def _measured(
    build: Callable[[], ModelBundle], make: Callable[[int], Sample], tokens: int,
    precision: str, ac: str, micro_batch: int,
) -> tuple[SampleRun | None, dict[str, float], str]:
    """One micro-batch's run and the rows per token of each Linear (by name), or (None,
    {}, why it failed)."""
    try:
        count = _count_run(build, make(micro_batch), tokens, precision)
        acts = _memory_run(build, make(micro_batch), precision, ac, sharded=False)
        sharded = acts if precision == "fp32" else _memory_run(
            build, make(micro_batch), precision, ac, sharded=True
        )
    except ModelError:  # the factory again: one line, as the first time
        raise
    except Exception as exc:  # the module's forward on fake tensors: said in the plan
        return None, {}, f"its forward and backward on fake tensors failed ({first_line(exc)})"
    per_token = micro_batch * tokens
    rows, pairs, flops, moved, ops_fw, ops_bw = count
    linear_flops = sum(6.0 * r * s.in_features * s.out_features for s, r in pairs) * per_token
    run = SampleRun(
        precision=precision, ac=ac, micro_batch=micro_batch,
        activations=acts[0] / micro_batch, activations_sharded=sharded[0] / micro_batch,
        activations_late=acts[1] / micro_batch,
        other_flops=max(0.0, flops - linear_flops) / per_token, moved_bytes=moved / per_token,
        forward_ops=ops_fw, backward_ops=ops_bw,
    )
    return run, rows, ""


class _Dispatched(TorchDispatchMode):
    """Counts the operations a step dispatches (views aside) and the bytes the ones that
    are no matmul read and write."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.moved = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils.flop_counter import flop_registry

        out = func(*args, **(kwargs or {}))
        if func.namespace != "aten" or func.is_view or func is torch.ops.aten._unsafe_view.default:
            return out  # a metadata query or a view: nothing dispatched to a kernel
        self.ops += 1
        if func.overloadpacket not in flop_registry:
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.moved += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _count_run(build, batch: Sample, tokens: int, precision: str):
    """The rows per token of each Linear (forward hooks, by name), (shape, rows) of each,
    the FLOPs (FlopCounterMode), the other operations' bytes and the operations of
    forward and backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        bundle = build()
    module = bundle.module
    layers = linears(module)
    seen: dict[int, float] = {}

    def hook(layer, inputs, _):
        rows = inputs[0].numel() / linear_shape(layer).in_features
        seen[id(layer)] = seen.get(id(layer), 0.0) + rows

    handles = [layer.register_forward_hook(hook) for _, layer in layers]
    with FakeTensorMode(allow_non_fake_inputs=True):
        module.to_empty(device="cpu")
        x, y = batch
        n = x.shape[0] * tokens
        with FlopCounterMode(display=False) as flops, _Dispatched() as forward, _autocast(
            precision
        ):
            loss = bundle.loss_fn(module(x), y)
        with FlopCounterMode(display=False) as back_flops, _Dispatched() as backward:
            loss.backward()
    for h in handles:
        h.remove()
    rows = {name: seen.get(id(m), 0.0) / n for name, m in layers}
    pairs = [(linear_shape(m), rows[name]) for name, m in layers]
    total = flops.get_total_flops() + back_flops.get_total_flops()
    moved = float(forward.moved + backward.moved)
    return rows, pairs, float(total), moved, forward.ops, backward.ops


def _memory_run(build, batch: Sample, precision: str, ac: str, sharded: bool) -> tuple[int, int]:
    """(the largest bytes of activations and temporaries over a forward and backward,
    those left when the last block's backward ends) of one micro-batch: single / DDP's
    (autocast in 16-bit) or FSDP's (`sharded`: the parameters in the 16-bit dtype), the
    blocks checkpointed as the runtime does it (`ac`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        bundle = build()
    module = bundle.module
    if sharded:
        module.to(TORCH_DTYPES[precision])
    _checkpoint(module, bundle.blocks, ac)
    with FakeTensorMode(allow_non_fake_inputs=True):
        module.to_empty(device="cpu")
        x, y = batch
        if sharded and x.is_floating_point():  # FSDP2 casts the inputs to param_dtype
            x = x.to(TORCH_DTYPES[precision])
        tracker = _activation_tracker()
        tracker.track_external(module, x, y)
        with tracker:
            with _autocast(precision) if not sharded else contextlib.nullcontext():
                loss = bundle.loss_fn(module(x), y)
            loss.backward()
    return tracker.largest, _after_last_block(tracker, bundle.blocks)


def _after_last_block(tracker, blocks: list[nn.Module]) -> int:
    """Bytes of activations and temporaries when the last block (the first to run
    backward) has finished its backward: what the blocks below still hold (the largest
    when there are no blocks)."""
    from torch.distributed._tools.mem_tracker import _ModState

    stats = tracker.memory_tracking.get(blocks[-1]) if blocks else None
    snaps = stats.snapshots.get(_ModState.POST_BW) if stats is not None else None
    if not snaps:
        return tracker.largest
    snap = next(iter(snaps[-1].values()))
    return sum(v for k, v in snap.items() if getattr(k, "value", k) in ("Activation", "Temp"))


def _activation_tracker():
    """PyTorch's MemTracker keeping, in place of its peaks (of the total, and per module:
    a walk over every module after every operation), the largest sum of activations and
    backward's temporaries."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class ActivationTracker(MemTracker):
        largest = 0

        def _update_peak_stats(self, peak_state) -> None:
            for snap in self._curr_mem_snap.values():
                now = snap[_MemRefType.ACT] + snap[_MemRefType.TEMP]
                self.largest = max(self.largest, now)

    return ActivationTracker()


def _checkpoint(module: nn.Module, blocks: list[nn.Module], ac: str) -> None:
    """Wrap the blocks in activation checkpointing as the runtime does."""
    if ac != "none":
        from trainwise.models.checkpointing import checkpoint_blocks

        checkpoint_blocks(module, list(blocks), ac)


def _autocast(precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type="cpu", dtype=TORCH_DTYPES[precision])
