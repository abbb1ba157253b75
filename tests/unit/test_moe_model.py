"""The Mixture-of-Experts model (models/moe): built on the meta device to its shape's
exact count, the grouped GEMM and the per-expert loop giving the same results, routing
(scores, renormalisation, the balancing bias that picks but never weighs, capacity), the
per-sequence balancing loss in the training loss, and the tokens each expert got counted
once a micro-batch (not again by the exposed-sync probe or activation checkpointing)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from trainwise.models import ModelSpec, build_model
from trainwise.models.moe import MOE_PRESETS, MoESpec
from trainwise.models.moe.balance import update_biases
from trainwise.models.moe.layers import GroupedExperts, MoE, Router, not_counted
from trainwise.models.moe.model import MoEModel

TINY = MOE_PRESETS["moe-tiny"]


def model(seed: int = 0, **kw) -> MoEModel:
    torch.manual_seed(seed)
    return MoEModel(replace(TINY, **kw) if kw else TINY)


def ids(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_meta_build_counts_the_shapes_parameters():
    with torch.device("meta"):
        bundle = build_model(ModelSpec("moe-tiny", vocab_size=300))
    params = dict(bundle.module.named_parameters())
    assert sum(p.numel() for p in params.values()) == bundle.moe.num_params()
    assert params["blocks.0.moe.experts.gate_proj"].shape == (8, 32, 64)  # [E, f, d]
    assert params["blocks.0.moe.experts.down_proj"].shape == (8, 64, 32)
    assert "blocks.1.moe.shared.down.weight" in params
    dense = replace(TINY, moe=replace(TINY.moe, dense_layers=1, d_dense=48), qk_norm=True, d_head=32)
    with torch.device("meta"):
        m = MoEModel(dense)
    assert sum(p.numel() for p in m.parameters()) == dense.num_params()
    assert m.blocks[0].moe is None and m.blocks[0].mlp.up.weight.shape == (48, 64)


def test_grouped_gemm_and_per_expert_loop_agree():
    """torch._grouped_mm runs on the CPU in fp32 (16-byte rows): the path CUDA takes in
    bf16 is checked against the loop, forward and backward."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    x = ids()
    runs = {}
    for kernel in ("grouped", "loop"):
        m = model()
        for block in m.blocks:
            block.moe.experts.kernel = kernel
        m(x).square().mean().backward()
        runs[kernel] = (m(x).detach(), m.blocks[1].moe.experts.gate_proj.grad.clone())
    torch.testing.assert_close(runs["grouped"][0], runs["loop"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs["grouped"][1], runs["loop"][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", ["loop", "grouped"])
def test_experts_that_got_no_rows_stay_in_backward(kernel: str):
    """Under expert parallelism a rank's experts can get no token at all (every token it
    routed went to another rank's experts, none came back): its experts' output must still
    depend on the rows and the weights, or autograd skips the combine's all-to-all in
    that rank's backward while its peers wait in theirs (a hang, found in torch's pipeline
    metadata inference), and its weights get no gradient where FSDP reduce-scatters one."""
    if kernel == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 8)
    experts.kernel = kernel
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    rows = torch.randn(0, 16, requires_grad=True)
    out = experts(rows, torch.zeros(4, dtype=torch.long))
    assert out.shape == (0, 16) and out.requires_grad
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in experts.parameters())


def test_runs_on_the_meta_device():
    with torch.device("meta"):
        m = MoEModel(TINY)
        out = m(torch.zeros(2, 16, dtype=torch.long))
    assert out.shape == (2, 16, TINY.vocab_size) and m.box.aux.shape == (2,)


def test_loop_matches_a_dense_mixture_by_hand():
    """Each token's output is the sum over its K experts of weight x expert(token), plus
    the shared expert's, computed here expert by expert for every token."""
    torch.manual_seed(0)
    moe = MoE(TINY).train()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, TINY.d_model)
    out, aux = moe(x)
    tokens = x.reshape(-1, TINY.d_model)
    weights, chosen, _ = moe.router(tokens)
    e = moe.experts
    want = moe.shared(tokens)
    for t in range(tokens.shape[0]):
        for k in range(TINY.moe.top_k):
            i = chosen[t, k]
            h = torch.nn.functional.silu(tokens[t] @ e.gate_proj[i].T) * (tokens[t] @ e.up_proj[i].T)
            want[t] = want[t] + weights[t, k] * (h @ e.down_proj[i].T)
    torch.testing.assert_close(out.reshape(-1, TINY.d_model), want, rtol=1e-5, atol=1e-6)
    assert aux.shape == (2,)


def test_router_scores_renormalisation_and_scale():
    torch.manual_seed(0)
    x = torch.randn(6, TINY.d_model)
    soft = Router(TINY)
    torch.nn.init.normal_(soft.gate.weight)
    w, chosen, scores = soft(x)
    torch.testing.assert_close(w.sum(-1), torch.ones(6))
    torch.testing.assert_close(scores.sum(-1), torch.ones(6))
    sig_shape = replace(TINY, moe=replace(TINY.moe, score="sigmoid", renormalize=False,
                                          route_scale=2.5))
    sig = Router(sig_shape)
    sig.gate.weight.data.copy_(soft.gate.weight)
    w2, chosen2, scores2 = sig(x)
    torch.testing.assert_close(w2, 2.5 * scores2.gather(-1, chosen2))
    assert torch.all(scores2 > 0) and torch.all(scores2 < 1)


def test_the_balancing_bias_picks_but_does_not_weigh():
    torch.manual_seed(0)
    router = Router(TINY)
    torch.nn.init.normal_(router.gate.weight)
    x = torch.randn(32, TINY.d_model)
    _, before, scores = router(x)
    router.expert_bias[3] = 10.0  # expert 3 wins every token's choice
    weights, chosen, _ = router(x)
    assert bool((chosen == 3).any(-1).all()) and not bool((before == 3).any(-1).all())
    picked = scores.gather(-1, chosen)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))


def test_capacity_drops_the_copies_past_it_in_token_order():
    torch.manual_seed(0)
    router = Router(TINY, capacity_factor=0.5)
    torch.nn.init.normal_(router.gate.weight)
    x = torch.randn(16, TINY.d_model)
    weights, chosen, _ = router(x)
    capacity = 0.5 * 16 * 2 / 8  # 2 copies an expert
    kept = weights > 0
    for e in range(8):
        mine = chosen == e
        assert int((mine & kept).sum()) == min(int(mine.sum()), capacity)
        # the first copies in token order are the kept ones
        order = mine.reshape(-1).nonzero().flatten()
        assert bool(kept.reshape(-1)[order[:2]].all())
    full = Router(TINY)
    full.gate.weight.data.copy_(router.gate.weight)
    assert bool((full(x)[0] > 0).all())  # no capacity: nothing dropped


def test_balancing_loss_is_per_sequence_and_in_the_training_loss():
    bundle = build_model(ModelSpec("moe-tiny", aux_loss_coef=0.5))
    m, loss_fn = bundle.module, bundle.loss_fn
    torch.manual_seed(0)
    for p in m.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.2)
    x = ids(batch=4)
    both = loss_fn(m(x), x)
    aux_both = loss_fn.last_aux
    m(x[:2])
    first = m.box.take()
    m(x[2:])
    second = m.box.take()
    m(x)
    whole = m.box.take()
    torch.testing.assert_close(whole, torch.cat([first, second]))  # a sequence's own
    torch.testing.assert_close(aux_both, 0.5 * whole.mean())
    assert float(aux_both) > 0.5 * 0.9  # about 1 a layer when near balance, >= by design
    m.eval()
    ce = loss_fn(m(x), x)
    assert loss_fn.last_aux is None  # evaluation: the cross entropy alone
    torch.testing.assert_close(both - aux_both, ce, rtol=1e-5, atol=1e-6)


def loads(m: MoEModel) -> list[torch.Tensor]:
    return [b.moe.router.load for b in m.blocks]


def test_tokens_are_counted_once_a_micro_batch():
    x = ids()
    m = model()
    m(x).sum().backward()
    once = [load.clone() for load in loads(m)]
    assert all(float(load.sum()) == 2 * 16 * TINY.moe.top_k for load in once)
    # The exposed-sync probe: the same micro-batch again with its loss x 0.
    (m(x).sum() * 0.0).backward()
    assert all(torch.equal(a, b) for a, b in zip(loads(m), once, strict=True))
    # A pass the engine marks as training nothing (torch's pipeline metadata inference).
    not_counted(lambda: m(x).sum().backward())()
    assert all(torch.equal(a, b) for a, b in zip(loads(m), once, strict=True))
    # Activation checkpointing recomputes a block's forward in backward: not counted again.
    c = model()
    h = c.tok_emb(x)
    for block in c.blocks:
        h, _ = checkpoint(block, h, use_reentrant=False)
    c.lm_head(c.norm(h)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(loads(c), once, strict=True))


def test_bias_update_moves_towards_balance_and_restarts_the_count():
    m = model()
    x = ids()
    m(x).sum().backward()
    load = m.blocks[0].moe.router.load.clone()
    update_biases([m], rate=0.01)
    bias = m.blocks[0].moe.router.expert_bias
    torch.testing.assert_close(bias, 0.01 * torch.sign(load.mean() - load))
    assert m.blocks[0].moe.router.load is None


def test_state_dict_holds_the_biases_for_a_resume():
    m = model()
    keys = set(m.state_dict())
    assert "blocks.0.moe.router.expert_bias" in keys
    assert not any("load" in k for k in keys)


def test_moe_spec_defaults_route_like_mixtral():
    spec = MoESpec(experts=8, top_k=2, d_expert=16)
    assert (spec.score, spec.renormalize, spec.route_scale, spec.shared_width) == (
        "softmax", True, 1.0, 0)
