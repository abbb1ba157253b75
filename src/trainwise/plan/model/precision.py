"""Bytes per element of each precision: the one place this fact lives."""

from __future__ import annotations

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# fp32 parameters, gradients and optimizer state whatever the compute precision (see
# plan.memory).
MASTER_BYTES = 4

# Bytes of optimizer state per parameter (fp32 states): AdamW keeps exp_avg and
# exp_avg_sq, SGD with momentum keeps one buffer.
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd": 4}

# A float8 element (e4m3 or e5m2): torchao's float8 training's GEMM inputs and, with FSDP's
# float8 all-gather, its gathered weights (plan.model.float8).
FLOAT8_BYTES = 1
