"""Checkpoint states over several model parts (pipeline stages on one rank, or one stage
per rank): the keys are the whole model's, each part saves and loads only its own, and one
optimizer over all parts resumes as the same optimizer over the whole model."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainwise.run.checkpoint.states import MODEL, OPTIMIZER, ModelState, OptimizerState


class Three(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 4)
        self.third = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.first, self.second, self.third):
            x = layer(x) if layer is not None else x
        return x


def _split(whole: Three) -> list[Three]:
    """Two stages as the splitter makes them: copies that drop the other's layers."""
    front, back = Three(), Three()
    front.load_state_dict(whole.state_dict())
    back.load_state_dict(whole.state_dict())
    front.third = None
    back.first = back.second = None
    return [front, back]


def _optimizer(parts: list[torch.nn.Module]) -> torch.optim.Optimizer:
    params = [p for part in parts for p in part.parameters()]
    # Two groups, one of which lies in one part only: a view drops the empty group.
    optimizer = torch.optim.AdamW(
        [{"params": params[:-2]}, {"params": params[-2:], "weight_decay": 0.0}], lr=0.01
    )
    # As the trainer's: the scheduler wraps the optimizer's step (a view must not call it).
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return optimizer


def _train(parts: list[Three], optimizer: torch.optim.Optimizer, steps: range) -> None:
    """Steps `steps` of one run: step i's batch depends on i only."""
    for step in steps:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for part in parts:
            x = part(x)
        x.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _save(parts: list[Three], optimizer: torch.optim.Optimizer, path: Path) -> None:
    state = {MODEL: ModelState(parts), OPTIMIZER: OptimizerState(parts, optimizer)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group: on purpose
        dcp.save(state, checkpoint_id=path, no_dist=True)


def _load(parts: list[Three], optimizer: torch.optim.Optimizer, path: Path) -> None:
    state = {MODEL: ModelState(parts), OPTIMIZER: OptimizerState(parts, optimizer)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path, no_dist=True)


def _weights(parts: list[Three]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for part in parts for k, v in part.state_dict().items()}


def test_the_optimizer_state_of_parts_has_the_whole_models_names_and_only_its_own():
    torch.manual_seed(0)
    whole = Three()
    optimizer = _optimizer([whole])
    _train([whole], optimizer, range(2))
    keys = set(OptimizerState([whole], optimizer).state_dict())
    assert "state.first.weight.exp_avg" in keys and "param_groups.third.bias.lr" in keys
    parts = _split(whole)
    split = OptimizerState(parts, _optimizer(parts)).state_dict()
    assert set(split) == keys  # two parts on one rank: the same keys as the whole
    back = OptimizerState([parts[1]], _optimizer([parts[1]])).state_dict()
    assert {k.split(".")[1] for k in back} == {"third"}  # a rank with the back stage only


def test_a_checkpoint_resumes_split_and_whole_again_bit_exact(tmp_path: Path):
    """Whole -> two parts (one optimizer over both) -> whole through DCP, two steps in
    each: the weights and optimizer state of one uninterrupted run of the whole model."""
    torch.manual_seed(0)
    ref = Three()
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt = _optimizer([ref])
    _train([ref], ref_opt, range(6))

    whole = Three()
    whole.load_state_dict(start)
    optimizer = _optimizer([whole])
    _train([whole], optimizer, range(2))
    _save([whole], optimizer, tmp_path / "a")

    torch.manual_seed(5)  # other weights: the load must replace every one
    parts = _split(Three())
    split_opt = _optimizer(parts)
    _load(parts, split_opt, tmp_path / "a")
    _train(parts, split_opt, range(2, 4))
    _save(parts, split_opt, tmp_path / "b")

    again = Three()
    again_opt = _optimizer([again])
    _load([again], again_opt, tmp_path / "b")
    _train([again], again_opt, range(4, 6))

    assert _weights([again]).keys() == _weights([ref]).keys()
    assert all(torch.equal(a, _weights([ref])[k]) for k, a in _weights([again]).items())
    mine = OptimizerState([again], again_opt).state_dict()
    theirs = OptimizerState([ref], ref_opt).state_dict()
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        same = torch.equal(mine[key], value) if torch.is_tensor(value) else mine[key] == value
        assert same, key


def _gpt(seed: int):
    from dataclasses import replace

    from trainwise.models.gpt import GPT
    from trainwise.models.shapes import PRESETS

    torch.manual_seed(seed)
    return GPT(replace(PRESETS["tiny"], tie_embeddings=False, d_model=32, d_ff=64))


def _gpt_steps(model, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(step))
        logits = model(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_the_splitters_gpt_stages_save_what_the_whole_model_resumes(tmp_path: Path):
    """Two stages cut by models/pipeline.split_gpt (sharing the whole model's parameters,
    one optimizer over them) write a checkpoint that a whole GPT loads and continues
    exactly; a rank holding the last stage writes only its blocks, norm and head."""
    from trainwise.models.pipeline import split_gpt

    model = _gpt(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _gpt_steps(model, optimizer, range(2))
    stages = [split_gpt(model, s, 2) for s in (0, 1)]
    last = {k.split(".")[1] for k in OptimizerState(stages[1:], optimizer).state_dict()}
    assert last == {"blocks", "norm", "lm_head"}
    assert set(ModelState(stages).state_dict()) == set(model.state_dict())
    _save(stages, optimizer, tmp_path / "stages")

    resumed = _gpt(7)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=0.01)
    _load([resumed], resumed_opt, tmp_path / "stages")
    _gpt_steps(model, optimizer, range(2, 4))
    _gpt_steps(resumed, resumed_opt, range(2, 4))
    theirs = resumed.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in model.state_dict().items())


def test_a_tied_embeddings_copies_on_one_rank_resume_with_their_own_state(tmp_path: Path):
    """In the V (ZBVZeroBubble) the first and last stages share a rank, and with a tied
    head both hold `tok_emb.weight` (the last a copy): one checkpoint entry, loaded into two
    parameters whose optimizer state must stay two tensors, or each step would update the
    shared moments twice."""
    from trainwise.models.pipeline import split_gpt

    def stages_and_optimizer(seed: int):
        from trainwise.models.gpt import GPT
        from trainwise.models.shapes import PRESETS

        torch.manual_seed(seed)
        model = GPT(PRESETS["tiny"])  # tied
        stages = [split_gpt(model, s, 2) for s in (0, 1)]
        params = [p for stage in stages for p in stage.parameters()]
        return stages, torch.optim.AdamW(params, lr=0.01)

    def step(stages, optimizer, seed: int):
        gen = torch.Generator().manual_seed(seed)
        for name, p in (x for stage in stages for x in stage.named_parameters()):
            # The same gradient for both copies of the embedding (the engine sums them).
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) if (
                name == "tok_emb.weight") else torch.randn(p.shape, generator=gen)
        optimizer.step()
        optimizer.zero_grad()

    stages, optimizer = stages_and_optimizer(0)
    copies = [stage.tok_emb.weight for stage in stages]
    assert copies[0] is not copies[1]
    step(stages, optimizer, 1)
    _save(stages, optimizer, tmp_path / "v")
    again, again_opt = stages_and_optimizer(3)
    _load(again, again_opt, tmp_path / "v")
    first, last = (again_opt.state[stage.tok_emb.weight] for stage in again)
    assert all(first[k] is not last[k] for k in first)
    step(stages, optimizer, 2)
    step(again, again_opt, 2)
    for a, b in zip(stages, again, strict=True):
        assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


class _NestedOptimizerState:
    """The optimizer state as trainwise wrote it before pipeline stages (DCP's nested
    format: one list of groups naming every parameter)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict):
        raise AssertionError("only written")


def _save_nested(model: Three, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """A checkpoint in the earlier format, as trainwise wrote it."""
    old = {MODEL: ModelState([model]), OPTIMIZER: _NestedOptimizerState(model, optimizer)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(old, checkpoint_id=path, no_dist=True)


def _load_nested(model: Three, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """An earlier-format checkpoint loaded as the checkpointer loads it (nested set by
    written_nested, cleared after)."""
    state = {MODEL: ModelState([model]), OPTIMIZER: OptimizerState([model], optimizer)}
    state[OPTIMIZER].nested = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    state[OPTIMIZER].nested = False


def test_a_checkpoint_of_the_earlier_optimizer_format_still_resumes(tmp_path: Path):
    """A checkpoint written before pipeline stages (nested optimizer state) is recognised
    from its metadata and loads into one part; into several, it is refused."""
    from trainwise.run.checkpoint.states import written_nested

    torch.manual_seed(0)
    whole = Three()
    optimizer = torch.optim.AdamW(whole.parameters(), lr=0.01)  # one group, as written then
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # as the trainer's
    _train([whole], optimizer, range(2))
    _save_nested(whole, optimizer, tmp_path / "old")
    _save([whole], optimizer, tmp_path / "new")
    assert written_nested(tmp_path / "old") and not written_nested(tmp_path / "new")

    again = Three()
    again_opt = _optimizer([again])
    _load_nested(again, again_opt, tmp_path / "old")
    mine = OptimizerState([again], again_opt).state_dict()
    theirs = OptimizerState([whole], optimizer).state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(v, mine[k]) for k, v in theirs.items() if torch.is_tensor(v))

    parts = _split(Three())
    split = OptimizerState(parts, _optimizer(parts))
    split.nested = True
    with pytest.raises(ValueError, match="without parallel.pp"):
        split.state_dict()


@pytest.mark.parametrize("saved, resumed", [("for-loop", "fused"), ("fused", "foreach")])
def test_the_resumed_step_runs_as_the_job_says_not_as_the_checkpoint_ran(
    tmp_path: Path, saved: str, resumed: str
):
    """optim.implementation is not part of the lineage: a checkpoint of one step resumes
    under another (its group settings are the job's), and trains on as the first would."""
    from trainwise.config.schema import OptimConfig
    from trainwise.run.engine.optim import build_optimizer

    torch.manual_seed(0)
    ref, model = Three(), Three()
    model.load_state_dict(ref.state_dict())
    ref_opt = build_optimizer([ref], OptimConfig(implementation=saved))
    _train([ref], ref_opt, range(4))
    first = build_optimizer([model], OptimConfig(implementation=saved))
    _train([model], first, range(2))
    _save([model], first, tmp_path / "ckpt")
    second = build_optimizer([model], OptimConfig(implementation=resumed))
    _load([model], second, tmp_path / "ckpt")
    group = second.param_groups[0]
    assert bool(group["fused"]) is (resumed == "fused")
    assert group["foreach"] is (True if resumed == "foreach" else None)
    _train([model], second, range(2, 4))
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_an_earlier_format_checkpoint_of_one_group_resumes_into_several(tmp_path: Path):
    """trainwise wrote one parameter group before it made one a device mesh: each of the
    job's groups takes the saved group's settings and the job's step, and its state."""
    torch.manual_seed(0)
    whole = Three()
    one = torch.optim.AdamW(whole.parameters(), lr=0.01, weight_decay=0.1)
    _train([whole], one, range(2))
    _save_nested(whole, one, tmp_path / "old")

    again = Three()
    params = list(again.parameters())
    two = torch.optim.AdamW(
        [{"params": params[:-2]}, {"params": params[-2:]}], lr=0.5, weight_decay=0.0, fused=True
    )
    _load_nested(again, two, tmp_path / "old")
    for group in two.param_groups:
        assert (group["lr"], group["weight_decay"], group["fused"]) == (0.01, 0.1, True)
    for mine, theirs in zip(params, whole.parameters(), strict=True):
        torch.testing.assert_close(two.state[mine]["exp_avg"], one.state[theirs]["exp_avg"])
