"""Which Linears float8 training converts: the one rule the runtime (models.float8.convert)
and the planner (plan.model.float8) share. No torch here: the planner imports it.

torchtitan's filter (torchtitan/components/quantization/utils.py, module_filter_fn): both
dimensions multiples of 16, which float8 tensor-core GEMMs require (torch._scaled_mm), and
not the output head, which torchtitan's float8 configs leave in high precision
(filter_fqns = ["output"]: the logits and the loss keep their precision).
"""

from __future__ import annotations

FLOAT8_MULTIPLE = 16
# The output head's module names: trainwise's GPT and Hugging Face (lm_head), torchtitan's
# Llama (output), a classifier's (head).
HEAD_NAMES = ("lm_head", "output", "head")


def float8_dims(in_features: int, out_features: int) -> bool:
    """Whether a Linear of these dimensions can run its GEMMs in float8."""
    return in_features % FLOAT8_MULTIPLE == 0 and out_features % FLOAT8_MULTIPLE == 0


def eligible(name: str, in_features: int, out_features: int) -> bool:
    """Whether the Linear `name` (its full module name) of these dimensions is converted."""
    return name.rsplit(".", 1)[-1] not in HEAD_NAMES and float8_dims(in_features, out_features)
