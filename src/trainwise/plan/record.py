"""The plan as JSON: the one definition of its schema (documented in the README).
Units: bytes, seconds, hours, US dollars; shares in [0, 1]."""

from __future__ import annotations

from trainwise.models.moe.cost import param_split
from trainwise.models.moe.shapes import MoEShape
from trainwise.plan.estimate import StrategyPlan
from trainwise.plan.inputs import SHAPE_FIELDS
from trainwise.plan.model.lora import param_counts
from trainwise.plan.planner import Plan
from trainwise.plan.search import describe_setup, setup_keys

SCHEMA_VERSION = 1


def _int(x: float | None) -> int | None:
    return None if x is None else int(round(x))


def strategy_record(s: StrategyPlan) -> dict:
    m = s.memory
    return {
        "name": s.name,
        "gpus": s.gpus,
        "micro_batch": s.micro_batch,
        "grad_accum": s.grad_accum,
        "fits": s.fits,
        "memory_per_gpu": {
            "params": _int(m.params),
            "grads": _int(m.grads),
            "optimizer": _int(m.optimizer),
            "model_states": _int(m.model_states),
            "activations": _int(m.activations),
            "buffers": _int(m.buffers),
            "overhead": _int(m.overhead),
            "total": _int(m.total),
            "peak_phase": m.phase,
        },
        "host_memory_per_node": _int(s.host_memory_per_node),
        "comm_bytes_per_step_per_gpu": _int(s.comm_bytes_per_step_per_gpu),
        "step": {
            "compute": s.step.compute,
            "bubble": s.step.bubble,
            "comm": s.step.comm,
            "exposed_comm": s.step.exposed_comm,
            "data": s.step.data,
            "total": s.step.total,
        },
        "tokens_per_s": s.tokens_per_s,
        "mfu": s.mfu,
        "scaling_efficiency": s.scaling_efficiency,
        "hours_to_train": s.hours_to_train,
        "cost": {
            "gpu_hours": s.cost.gpu_hours,
            "compute_usd": s.cost.compute_usd,
            "comm_wait_usd": s.cost.comm_wait_usd,
            "failure_retry_usd": s.cost.failure_retry_usd,
            "total_usd": s.cost.total_usd,
        },
        "checkpoint": {
            "interval_min": s.checkpoint.interval_min,
            "expected_failures": s.checkpoint.expected_failures,
            "save_s": s.checkpoint.save_s,
            "size_bytes": _int(s.checkpoint.size_bytes),
        },
    }


def inputs_record(plan: Plan) -> dict:
    i = plan.inputs
    w, hw = i.workload, i.hardware
    trainable, total = param_counts(w.params, w.shape, w.lora)
    shape = None
    if w.shape is not None:
        shape = {key: getattr(w.shape, field) for key, field in SHAPE_FIELDS.items()}
    return {
        "model": i.model,
        "params": w.params,
        # LoRA: the adapters and what else trains, and the model with its adapters.
        "trainable_params": trainable,
        "total_params": total,
        "lora_rank": w.lora.rank if w.lora else 0,
        "shape": shape,
        "moe": moe_record(w.moe, w.imbalance) if w.moe is not None else None,
        "seq_len": w.seq_len,
        "micro_batch": w.micro_batch,
        "global_batch": i.global_batch,
        "tokens": i.tokens,
        "precision": w.precision,
        # Float8 training (plan.model.float8): the recipe, and whether FSDP's all-gather
        # moves the float8 weights (asked, and possible: tensorwise).
        "float8": w.float8,
        "float8_all_gather": w.float8 == "tensorwise" and w.float8_all_gather,
        "optimizer": w.optimizer,
        "ac": w.ac,
        "gpu": hw.gpu,
        "gpus": i.gpus,
        "gpus_per_node": i.gpus_per_node,
        "nodes": i.nodes,
        "gpu_memory_bytes": _int(hw.memory_bytes),
        "gpu_peak_flops": hw.peak_flops,
        "gpu_fp8_peak_flops": hw.fp8_flops or None,
        "efficiency": i.efficiency,
        "intra_node_bytes_per_s": hw.intra_bps,
        "inter_node_bytes_per_s": hw.inter_bps,
        "price_per_gpu_hour": hw.price_per_gpu_hour,
        "mtbf_hours_per_node": i.mtbf_hours,
        "restart_s": i.restart_s,
        "checkpoint_bytes_per_s_per_node": i.checkpoint_bps,
        "checkpoint_latency_s": i.checkpoint_latency_s,
        "runtime_memory_bytes": i.memory_overhead_bytes,
        "data_samples_per_s_per_gpu": i.data_samples_per_s,
        "headroom": i.headroom,
        "objective": i.objective,
        "calibration": list(plan.calibration),
    }


def moe_record(shape: MoEShape, imbalance: float) -> dict:
    """A Mixture-of-Experts model's shape and parameters: total and active (a token runs
    through), dense and routed experts', and the imbalance priced."""
    m = shape.moe
    return {
        "layers": shape.n_layer, "hidden": shape.d_model, "heads": shape.n_head,
        "kv_heads": shape.n_kv_head, "head_dim": shape.head_dim, "vocab": shape.vocab_size,
        "experts": m.experts, "top_k": m.top_k, "expert_ffn": m.d_expert,
        "shared_experts": m.shared_experts, "dense_layers": m.dense_layers,
        "total_params": shape.num_params(), "active_params": shape.active_params(),
        "expert_params": shape.expert_total(), "dense_params": param_split(shape).dense,
        "imbalance": imbalance,
    }


def recommendation_record(plan: Plan) -> dict:
    """The recommendation: its row name, scenario and reasons; the configuration (layout,
    knobs and the job-file keys that run it, `config`), its figures; the alternatives."""
    rec = plan.recommendation
    out: dict = {
        "strategy": rec.strategy,
        "scenario": rec.scenario,
        "reasons": list(rec.reasons),
    }
    if rec.choice is not None:
        c = rec.choice
        out |= {
            "fits": c.fits,
            "configuration": describe_setup(c.setup),
            "layout": c.dims.degrees() | {"fsdp": c.dims.fsdp},
            "config": c.config_keys(),
            "plan": strategy_record(c.plan),
            "alternatives": [
                {"configuration": describe_setup(s.setup), "config": setup_keys(s.setup),
                 "why_not": why, "plan": strategy_record(s)}
                for s, why in rec.alternatives
            ],
        }
    return out


def plan_record(plan: Plan) -> dict:
    out = {
        "schema_version": SCHEMA_VERSION,
        "inputs": inputs_record(plan),
        "strategies": [strategy_record(s) for s in plan.strategies],
        "recommendation": recommendation_record(plan),
        "questions": [{"question": q, "answer": a} for q, a in plan.questions],
        "warnings": list(plan.warnings),
    }
    if plan.sweep:
        out["sweep"] = [
            {
                "gpus": r.gpus,
                "strategy": r.strategy,
                "fits": r.fits,
                "tokens_per_s": r.tokens_per_s,
                "scaling_efficiency": r.scaling_efficiency,
                "step_s": r.step_s,
                "hours_to_train": r.hours_to_train,
                "total_usd": r.total_usd,
                "configuration": r.configuration or None,
            }
            for r in plan.sweep
        ]
        out["knees"] = dict(sorted(plan.knees.items()))
    return out
