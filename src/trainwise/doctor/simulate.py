"""Measure the per-rank peak memory of one training step without the memory: trainwise's
real model and real engine code (run/engine: parallelize, optim, and the training step
the trainer builds, trainer.build_step) on fake tensors, over PyTorch's fake process
group of the target world size (one process plays rank 0; collectives do nothing but have the right buffers), under PyTorch's memory
trackers (torch.distributed._tools: MemTracker for single/DDP, FSDPMemTracker for FSDP2).

It is a measurement, like the doctor's, so it lives here and `trainwise plan --simulate`
composes it with the formula. Kernels are this machine's (CPU): the formula it is compared
with is `estimate_memory(..., device="cpu")`.

Two steps run; the second is read. On the first, AdamW creates its state and DTensor's
sharding propagation (cached afterwards) runs full-size fake ops that the tracker counts.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial

from trainwise.config.parallel_dims import PLAN_NAMES, ParallelDims, row_layout
from trainwise.errors import ConfigError
from trainwise.models.moe.shapes import MoEShape
from trainwise.models.shapes import GPTShape, ModelProfile
from trainwise.plan.estimate import Setup, layout_name
from trainwise.plan.model.lora import LoraPlan
from trainwise.plan.model.pipeline import Stage, worst_stage

STEPS = 2

# Tracker categories (the enums' values) -> the formula's parts.
PART = {
    "Parameter": "params",
    "Sharded Param": "params",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "activations",  # intermediates of backward and of recomputation
    "Unsharded Param": "buffers",
    "Unsharded Grad": "buffers",
    "All Gather": "buffers",
    "Reduce Scatter": "buffers",
    "Other": "buffers",  # DDP's buckets (relabelled) and the batch
    "Buffer": "buffers",  # module buffers (rope tables)
    "Inputs": "buffers",
}


@dataclass(frozen=True)
class Simulation:
    strategy: str
    world: int
    peak_bytes: int
    parts: dict[str, int]  # at the peak, by the formula's parts


def simulate_layout(
    shape: GPTShape | MoEShape | ModelProfile,
    dims: ParallelDims,
    precision: str = "fp32",
    micro_batch: int = 1,
    seq_len: int | None = None,
    ac: str = "none",
    reduce_dtype: str = "fp32",
    optimizer: str = "adamw",
    sequence_parallel: bool = True,
    lora: LoraPlan | None = None,
) -> Simulation:
    """The peak of one steady-state training step of a GPT or a Mixture-of-Experts model of
    `shape` (or of the module a ModelProfile was read from, on a micro-batch of its sample)
    on rank 0 of a layout that `simulated` accepts, as the runtime runs it
    (ParallelDims.runnable): its mesh over the fake process group of dims.world ranks,
    tensor parallelism with the model's own plan (sequence parallel unless told), expert
    parallelism with the model's ExpertParallel (rank 0's experts; fake tensors carry no
    routing to exchange, so its rows stay and its experts run an even share of them, as
    balanced routing would hand it); with `lora`, the model as the LoRA converter
    (models.lora) turns it."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import _MemRefType, _UpdateType
    from torch.optim.lr_scheduler import LambdaLR
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainwise.config.schema import OptimConfig
    from trainwise.models.converters import adapt_tp_plan, convert
    from trainwise.run.engine.mesh import job_mesh
    from trainwise.run.engine.optim import build_optimizer
    from trainwise.run.engine.parallelize import parallelize
    from trainwise.run.engine.trainer import build_step, local_loss

    if not simulated(dims):
        raise ValueError(f"cannot simulate {layout_name(dims)}; simulated: {', '.join(SIMULATED)}")
    dims = dims.runnable()
    world = dims.world
    device = torch.device("cpu")
    optim_cfg = OptimConfig(name=optimizer)
    # The model is a DTensor one (tracked by FSDPMemTracker) unless it is plain or DDP's.
    dtensors = dims.fsdp or dims.tp > 1 or dims.ep > 1
    warnings.filterwarnings("ignore", message="DTensor random operators")
    # The experts' even runs on fake tensors are a view of their output (models/moe/
    # layers.py _padded), which the layer only reads.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")

    with _fake_world(dist, FakeStore, world), _ddp_on_fake_tensors():
        # Built on meta outside the fake mode (the model's meta -> to_empty swap fails inside
        # it), sharded there too (fully_shard builds the mesh), then materialised as fakes.
        with torch.device("meta"):
            bundle, batch = _bundle(shape, seq_len)
        model, blocks, loss_fn = bundle.module, list(bundle.blocks), local_loss(bundle.loss_fn)
        converters = _converters(lora, precision)
        convert(model, converters)
        mesh = job_mesh(dims, device.type)  # once, outside the fake mode (it reads values)
        if dtensors:
            tp_plan = bundle.tp_plan(sequence_parallel) if dims.tp > 1 and bundle.tp_plan else None
            if tp_plan is not None:
                tp_plan = adapt_tp_plan(model, tp_plan, converters)
            ep_plan = bundle.ep_plan(model, None) if dims.ep > 1 and bundle.ep_plan else None
            model = parallelize(
                model, blocks, dims, device=device, precision=precision,
                reduce_dtype=reduce_dtype, ac=ac, tp_plan=tp_plan, mesh=mesh, ep_plan=ep_plan,
            )
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device=device)
            # A tensor-parallel group reads the same micro-batch on every rank.
            x, y = batch(micro_batch)
            tracker, opt = _tracker_for(model, dims, dtensors, optim_cfg, x, y)
            with tracker:
                if not dtensors:
                    # DDP inside the tracker so that its buckets are seen (as "Other").
                    before = {id(w) for w, _ in tracker._WINFO.values()}
                    model = parallelize(
                        model, blocks, dims, device=device, precision=precision, ac=ac,
                        mesh=mesh,
                    )
                    _relabel_new(tracker, before, _MemRefType.OTH, _UpdateType)
                    if not dims.single:
                        _fake_comm_hook(torch, dist, model, world)
                    opt = build_optimizer([model], optim_cfg)
                # The training step itself (run/engine/step.py), on one micro-batch,
                # without the non-finite check (fake tensors hold no values).
                step = build_step(
                    dims, precision, device, loss_fn, opt, LambdaLR(opt, lambda _: 1.0), None,
                    1, 1.0, guard=False,
                )
                for _ in range(STEPS):
                    _reset_peak(tracker)
                    step.step([model], iter([(x, y)]), probe=False)
                    snapshot = tracker.get_tracker_snapshot("peak").get(device, {})
                    tracker.reset_mod_stats()
    peak, parts = _peak_by_part(snapshot)
    return Simulation(layout_name(dims), world, peak, parts)


def _bundle(what: GPTShape | MoEShape | ModelProfile, seq_len: int | None):
    """(the model's bundle, built on the current device, and a function making a
    micro-batch (x, y)): a GPT or a MoE model (the runtime's bundle, models.moe.build:
    its loss, tensor- and expert-parallel plans) of a shape on token ids of `seq_len`
    (default its own), or the module a profile was read from, on its sample."""
    import torch

    from trainwise.models.gpt import GPT
    from trainwise.models.gpt_parallel import gpt_tp_plan
    from trainwise.models.moe.build import moe_bundle
    from trainwise.models.registry import ModelBundle, ModelSpec, cross_entropy_loss

    if isinstance(what, ModelProfile):
        return what.rebuild(), what.sample
    seq = seq_len or what.max_seq_len
    sized = replace(what, max_seq_len=max(seq, what.max_seq_len))

    def ids(micro_batch: int):
        shape = (micro_batch, seq)
        return torch.randint(0, what.vocab_size, shape), torch.randint(0, what.vocab_size, shape)

    if isinstance(what, MoEShape):
        return moe_bundle(sized, ModelSpec(name="moe")), ids
    gpt = GPT(sized)
    tp = partial(gpt_tp_plan, gpt)
    return ModelBundle(gpt, cross_entropy_loss, list(gpt.blocks), what, tp_plan=tp), ids


def _converters(lora: LoraPlan | None, precision: str) -> list:
    """The job's converters for a planner's `lora` (none without): models.lora's, built
    from the [lora] keys the plan read."""
    from trainwise.config import JobConfig
    from trainwise.models.converters import build_converters

    if lora is None:
        return []
    keys = {
        "rank": lora.rank, "dropout": lora.dropout, "train_embeddings": lora.train_embeddings,
        "train_head": lora.train_head,
    }
    if lora.targets is not None:
        keys["targets"] = list(lora.targets)
    return build_converters(JobConfig(lora=keys, precision={"dtype": precision}))


def simulate_stage(
    shape: GPTShape, setup: Setup, stage: Stage, precision: str = "fp32",
    seq_len: int | None = None, optimizer: str = "adamw", lora: LoraPlan | None = None,
) -> Simulation:
    """The peak of pipeline rank `stage` of `setup` (a stage of one rank, or sharded by FSDP
    over dp_shard fake ranks: no replicas, tp 1) over a step as its schedule orders it on
    that rank: stage.in_flight forwards ahead, then a backward and a forward in turn, the
    last backwards, the optimizer. The stage is the one the runtime trains
    (models.pipeline.split_gpt of the meta model), under FSDP with the runtime's rule for
    stages (kept gathered: ParallelDims) and pipelining's for its backwards (no
    gradient sync nor reshard but at the last, backward_maybe_with_nosync); the loss on
    the last stage, and a stage that is not the last gets its output's gradient as the
    next stage would send it; with `lora`, cut from the model the LoRA converter turned,
    as the runtime converts before it splits."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainwise.config.schema import OptimConfig
    from trainwise.models.converters import convert
    from trainwise.models.gpt import GPT
    from trainwise.models.pipeline import rank_stages, split_gpt
    from trainwise.models.registry import cross_entropy_loss
    from trainwise.run.engine.parallelize import parallelize
    from trainwise.run.engine.precision import autocast_context

    seq = seq_len or shape.max_seq_len
    device, b, m, pp = torch.device("cpu"), setup.micro_batch, setup.grad_accum, setup.dims.pp
    with torch.device("meta"):
        gpt = GPT(replace(shape, max_seq_len=max(seq, shape.max_seq_len)))
    convert(gpt, _converters(lora, precision))
    (index,) = rank_stages(stage.rank, pp, setup.virtual, setup.schedule)  # one a rank
    model = split_gpt(gpt, index, pp * setup.virtual)
    sharded = setup.dims.fsdp and setup.dims.dp_shard > 1
    # The stage's own data parallelism, as parts.py applies it on the mesh's other dims.
    inside = replace(setup.dims, pp=1) if sharded else ParallelDims()
    with _fake_world(dist, FakeStore, inside.world):
        model = parallelize(model, model.layers(), inside, device=device,
                            precision=precision, ac=setup.ac)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device=device)
            y = torch.randint(0, shape.vocab_size, (b, seq))
            tracker, opt = _tracker_for(model, inside, True, OptimConfig(name=optimizer), y)

            class MicroBatch(nn.Module):
                """A fresh top module per micro-batch: the tracker refuses one top module
                called again before its backward."""

                def __init__(self) -> None:
                    super().__init__()
                    self.stage = model

                def forward(self, x):
                    return self.stage(x)

            def forward():
                if stage.embeddings:
                    x = torch.randint(0, shape.vocab_size, (b, seq))
                else:
                    # The activation the previous stage sends (the fp32 residual stream),
                    # without its gradient (one such tensor, sent back): the tracker's hooks
                    # on a module's inputs would keep every micro-batch's alive.
                    x = torch.randn(b, seq, shape.d_model)
                top = MicroBatch()
                out = top(x)
                return top, cross_entropy_loss(out, y) / m if stage.head else out

            def backward(pair, last: bool):
                _, out = pair  # the top module lives until its backward (the tracker's hooks)
                if sharded:  # pipelining's backward_maybe_with_nosync
                    model.set_requires_gradient_sync(last, recurse=True)
                    model.set_reshard_after_backward(last, recurse=True)
                out.backward() if stage.head else out.backward(torch.ones_like(out))

            # One autocast region a step (its cache keeps one 16-bit copy of each weight
            # for all the micro-batches in flight).
            with tracker, autocast_context(False, precision, device):
                snapshot = _stage_steps(tracker, opt, forward, backward, m, stage.in_flight,
                                        device)
    peak, parts = _peak_by_part(snapshot)
    return Simulation(layout_name(setup.dims), setup.dims.world, peak, parts)


def _stage_steps(tracker, opt, forward, backward, micro_batches: int, in_flight: int,
                 device) -> dict:
    """STEPS steps of a pipeline rank as its schedule orders them (`in_flight` forwards
    ahead, then a backward and a forward in turn, the last backwards, the optimizer);
    the last step's peak snapshot on `device`."""
    for _ in range(STEPS):
        _reset_peak(tracker)
        pending, done = [], 0
        for _ in range(micro_batches):
            pending.append(forward())
            if len(pending) >= in_flight:
                done += 1
                backward(pending.pop(0), done == micro_batches)
        while pending:
            done += 1
            backward(pending.pop(0), done == micro_batches)
        opt.step()
        opt.zero_grad(set_to_none=True)
        snapshot = tracker.get_tracker_snapshot("peak").get(device, {})
        tracker.reset_mod_stats()
    return snapshot


def _tracker_for(model, dims: ParallelDims, dtensors: bool, optim_cfg, *inputs):
    """The step's memory tracker, and the optimizer where it is built before the step (a
    DTensor model's: FSDPMemTracker needs it); None for DDP's, built inside the tracker so
    that its buckets are seen."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainwise.run.engine.optim import build_optimizer

    if not dtensors:
        tracker = global_peak_only(MemTracker())
        tracker.track_external(model, *inputs)
        _skip_frozen(tracker, model)
        return tracker, None
    opt = build_optimizer([model], optim_cfg)
    tracker = global_peak_only(FSDPMemTracker(model, opt) if dims.fsdp else MemTracker())
    if dims.fsdp:
        tracker.track_inputs(inputs)
    else:
        tracker.track_external(model, opt, *inputs)
        _skip_frozen(tracker, model)
    return tracker, opt


def global_peak_only(tracker):
    """`tracker` keeping only the peak of the whole step, which is all a simulation reads
    (get_tracker_snapshot("peak")). MemTracker also keeps each module's own peak, walking
    every module it has seen at every operation (ops x modules): most of a simulation's
    time, 3x for LoRA's many small modules."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY as TOTAL

    def update_peak(_state) -> None:  # MemTracker._update_peak_stats's second half
        for dev, snap in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(dev, 0) < snap[TOTAL]:
                tracker._peak_mem[dev] = snap[TOTAL]
                tracker._peak_mem_snap[dev] = dict(snap)

    tracker._update_peak_stats = update_peak
    return tracker


class _NoHook:
    def remove(self) -> None:
        pass


def _skip_frozen(tracker, model) -> None:
    """MemTracker hooks every parameter's gradient, which a frozen one (LoRA's base) cannot
    take: mark those as hooked already (they have no gradient to count)."""
    for param in model.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())


def _peak_by_part(snapshot: dict) -> tuple[int, dict[str, int]]:
    """The tracker's peak snapshot as (total bytes, bytes by the formula's parts)."""
    parts = dict.fromkeys(("params", "grads", "optimizer", "activations", "buffers"), 0)
    for key, value in snapshot.items():
        part = getattr(key, "value", key)
        if part != "Total":
            parts[PART[part]] += int(value)
    return int(snapshot.get("Total", sum(parts.values()))), parts


@contextlib.contextmanager
def _fake_world(dist, store_cls, world: int) -> Iterator[None]:
    if dist.is_initialized():
        raise RuntimeError("simulate_layout needs a process without a process group")
    dist.init_process_group("fake", store=store_cls(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _ddp_on_fake_tensors() -> Iterator[None]:
    """DDP's construction reads tensor values (the parameter shape check and the broadcast
    of module states); with fake tensors there are none. Nothing they do allocates."""
    import torch.nn.parallel.distributed as ddp

    saved = ddp._verify_param_shape_across_processes, ddp._sync_module_states
    ddp._verify_param_shape_across_processes = lambda *a, **k: None
    ddp._sync_module_states = lambda *a, **k: None
    try:
        yield
    finally:
        ddp._verify_param_shape_across_processes, ddp._sync_module_states = saved


def _fake_comm_hook(torch, dist, model, world: int) -> None:
    """The default all-reduce hook gets no result from the fake group's work and DDP's
    reducer asserts; this hook does the same in place (divide, all-reduce) and returns the
    bucket. DDP's bucket rebuild after the first step reads values: skipped, which only
    loses its one-off overlap (the rebuilt buckets have the same total size)."""

    def allreduce(state, bucket):
        buf = bucket.buffer()
        buf.div_(world)
        dist.all_reduce(buf)
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    model.register_comm_hook(None, allreduce)

    class NoRebuild:
        def __init__(self, reducer):
            object.__setattr__(self, "_reducer", reducer)

        def __getattr__(self, name):
            return getattr(self._reducer, name)

        def _rebuild_buckets(self):
            return False

    model.reducer = NoRebuild(model.reducer)


def _relabel_new(tracker, before: set[int], reftype, update_type) -> None:
    """Storages the tracker met since `before` (DDP's buckets) get `reftype`."""
    for winfo, _ in list(tracker._WINFO.values()):
        if id(winfo) not in before and winfo.reftype != reftype:
            old, winfo.reftype = winfo.reftype, reftype
            tracker._update_snap(update_type.REF, winfo, old_reftype=old)


def _reset_peak(tracker) -> None:
    """The trackers keep their peak across steps and have no API to reset it."""
    tracker._peak_mem_snap = tracker.get_tracker_snapshot()
    tracker._peak_mem = {d: s["Total"] for d, s in tracker._peak_mem_snap.items()}


def simulate_plan(plan, progress=None, rows: list | None = None) -> list[dict]:
    """Simulate each of `rows` (default: the plan's named strategies; the CLI passes the
    rows its tables print, the chosen configuration among them, tensor-parallel or not)
    that one fake rank can play, at its GPU count, precision, per-GPU micro-batch and
    checkpointing; beside each, the formula for the same kernels (this machine's) and the
    plan's own figure (the target GPU's kernels and overhead)."""
    from trainwise.plan.estimate import knob_workload
    from trainwise.plan.model.memory import estimate_memory

    w = plan.inputs.workload
    # Your own module is simulated itself (as it trains), on its sample; a Mixture-of-
    # Experts model as the runtime builds it, with its expert-parallel plan.
    what = w.profile if w.profile is not None else w.moe or w.shape
    if what is None:
        raise ValueError("a bare parameter count has no model to simulate")
    if w.profile is not None and w.profile.sample is None:
        raise ConfigError(
            f"--simulate: model {w.profile.source} takes no token ids and no sample batch "
            "came from the job's data: give the job a dataset (data.dataset), or plan "
            "without --simulate"
        )
    out = []
    for s in plan.strategies if rows is None else rows:
        setup = _setup(s, w.ac)
        if not simulated(setup.dims, setup.virtual):
            continue
        if setup.dims.pp > 1 and w.moe is not None:
            continue  # simulate_stage cuts the GPT: a MoE model's stages are not simulated
        dims = setup.dims
        if progress:
            progress(f"simulating {s.name} on {dims.world} fake ranks ...")
        knobbed = knob_workload(w, setup.micro_batch, setup.ac)
        if dims.pp > 1:  # its worst stage, over the schedule's micro-batches
            stage, here = worst_stage(knobbed, setup, "cpu")
            sim = simulate_stage(
                w.shape, setup, stage, w.precision, w.seq_len, w.optimizer, w.lora
            )
        else:
            sim = simulate_layout(
                what, dims, w.precision, setup.micro_batch, w.seq_len, setup.ac,
                w.reduce_dtype, w.optimizer, setup.sequence_parallel, w.lora,
            )
            # The simulation runs one micro-batch a step: the formula without accumulation.
            here = estimate_memory(knobbed, replace(setup, grad_accum=1), "cpu")
        out.append(
            {
                "strategy": s.name,
                "gpus": s.gpus,
                "simulated_peak_bytes": sim.peak_bytes,
                "formula_peak_bytes": int(here.total),
                "gap": (here.total - sim.peak_bytes) / sim.peak_bytes,
                "plan_total_bytes": int(s.memory.total),
                "parts": sim.parts,
            }
        )
    return out


def simulated(dims: ParallelDims, virtual: int = 1) -> bool:
    """Whether one fake rank can play the layout as the runtime runs it (runnable): single,
    ddp, FSDP, with tensor parallelism or without, with the experts split over ep or not
    (not hsdp, nor ddp with ep, which runs as FSDP2's replication: that fails on the fake
    process group; not cpu offload: host memory is not tracked); pipeline stages of one
    rank each or sharded by FSDP (no replicas, no tensor parallelism inside a stage), one
    stage per rank."""
    if dims.pp > 1:
        alone = dims.dp_size == 1 or (dims.fsdp and dims.dp_replicate == 1)
        return alone and dims.tp == 1 and not dims.cpu_offload and virtual == 1
    runs = dims.runnable()
    return not runs.hybrid and not runs.cpu_offload


SIMULATED = tuple(n for n in PLAN_NAMES if simulated(row_layout(n)))  # the planner's rows


def _setup(s, ac: str):
    """The configuration a row priced (a row built by hand: its named layout)."""
    from trainwise.plan.estimate import Setup

    if s.setup is not None:
        return s.setup
    return Setup(ParallelDims.from_plan_name(s.name, s.gpus, s.gpus), ac, s.micro_batch, 1)
