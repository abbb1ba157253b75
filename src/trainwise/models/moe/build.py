"""A MoE model as the runtime takes it (the registry's ModelBundle): the model, its loss
with the balancing term, its blocks, its tensor- and expert-parallel plans and
per-parameter init."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from trainwise.models.moe.model import MoELoss, MoEModel
from trainwise.models.moe.parallel import moe_ep_plan, moe_tp_plan
from trainwise.models.moe.shapes import MoEShape

if TYPE_CHECKING:
    from trainwise.models.registry import ModelBundle, ModelSpec


def moe_bundle(
    shape: MoEShape, spec: ModelSpec,
    load_weights: Callable[..., dict[str, int]] | None = None,
) -> ModelBundle:
    """The MoE model of `shape` built on the current device with the job's [moe] settings
    (`spec`: its dropout, balancing loss weight and capacity factor)."""
    from trainwise.models.registry import ModelBundle

    model = MoEModel(shape, spec.dropout, spec.capacity_factor, aux_loss=spec.aux_loss_coef > 0)
    return ModelBundle(
        model, MoELoss(model.box, spec.aux_loss_coef), list(model.blocks), None,
        load_weights=load_weights, tp_plan=partial(moe_tp_plan, model),
        init_parameter=model.init_parameter, moe=shape, ep_plan=moe_ep_plan,
    )
