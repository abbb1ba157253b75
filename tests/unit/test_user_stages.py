"""Your own module in pipeline stages, without a launch: the stages cut by the convention
(models/pipeline.py split_module: torchtitan's), chained, give the whole model's output
under the whole model's names, whatever container holds the blocks; a tied head's copy
on the last stage checkpoints under the whole model's names both ways; the meta build
keeps a tie; a tensor-parallel plan keeps the entries of a stage's modules; and each
module that cannot be cut is refused in one line before any worker."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from trainwise.config import load_config
from trainwise.errors import ConfigError
from trainwise.hardware import GB, DeviceInfo
from trainwise.models.pipeline import module_cut, split_module, stage_info, stage_layers
from trainwise.run.checkpoint.states import MODEL, OPTIMIZER, ModelState, OptimizerState
from trainwise.run.engine.materialize import allocate
from trainwise.run.engine.parts import held_plans
from trainwise.run.engine.pipeline import sync_tied_grads
from trainwise.run.job.resolve import prepare_job
from user_lm import UserLM, smoothed_loss

CPU = DeviceInfo("cpu", "cpu", 1, 64 * GB, bf16=True, fp16=False, gpu=None)


def _stages(model: nn.Module, stages: int) -> list[nn.Module]:
    cut = module_cut(model, "the model")
    return [split_module(model, s, stages, cut) for s in range(stages)]


def _chain(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("blocks", ["dict", "list", "sequential"])
@pytest.mark.parametrize("stages", [2, 4])
def test_stages_chained_give_the_whole_models_logits_under_its_names(blocks, stages):
    torch.manual_seed(0)
    model = UserLM(blocks=blocks)
    x = torch.randint(0, 256, (2, 16))
    parts = _stages(model, stages)
    assert torch.equal(_chain(parts, x), model(x))
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each once
    # The embedding on the first stage only, the final norm and head on the last only.
    assert parts[0].tok_emb is model.tok_emb and parts[0].head is None
    assert parts[-1].tok_emb is None and parts[-1].norm is model.norm
    # Torchtitan's split: the embeddings and the head weigh a block each (4 + 2 over 2).
    held = [[k for k, _ in part.layers.named_children()] for part in parts]
    assert held == ([["0", "1"], ["2", "3"]] if stages == 2 else [["0"], ["1"], ["2"], ["3"]])
    assert [len(stage_layers(p)) for p in parts] == [len(h) for h in held]
    assert type(parts[1].layers) is type(model.layers)


def test_a_tied_head_is_a_copy_on_the_last_stage_under_its_own_name():
    torch.manual_seed(0)
    model = UserLM(tie=True)
    first, last = _stages(model, 2)
    assert stage_info(first).ties == stage_info(last).ties == {"head.weight": "tok_emb.weight"}
    copy = last.head.weight
    assert copy is not model.tok_emb.weight and torch.equal(copy, model.tok_emb.weight)
    assert last.head is not model.head and first.head is None  # the model is not touched
    assert model.head.weight is model.tok_emb.weight
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(_chain([first, last], x), model(x))


class WithRotary(nn.Module):
    """A child without parameters used by every block, and a buffer of the model's own:
    both stay on every stage."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.scale = nn.Identity()  # no parameters, registered before the blocks
        self.register_buffer("offset", torch.full((8,), 0.5))
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 16)

    def forward(self, x):
        h = self.emb(x) if self.emb is not None else x
        for layer in self.layers:
            h = self.scale(layer(h)) + self.offset
        return self.head(h) if self.head is not None else h


def test_children_without_parameters_and_the_models_buffers_stay_on_every_stage():
    torch.manual_seed(0)
    model = WithRotary()
    parts = _stages(model, 2)
    assert all(p.scale is model.scale and torch.equal(p.offset, model.offset) for p in parts)
    x = torch.randint(0, 16, (2, 5))
    assert torch.equal(_chain(parts, x), model(x))


# -- checkpoints of a tied head's copy -------------------------------------------------------


def _save(parts, optimizer, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group: on purpose
        dcp.save({MODEL: ModelState(parts), OPTIMIZER: OptimizerState(parts, optimizer)},
                 checkpoint_id=path, no_dist=True)


def _load(parts, optimizer, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({MODEL: ModelState(parts), OPTIMIZER: OptimizerState(parts, optimizer)},
                 checkpoint_id=path, no_dist=True)


def _step(parts: list[nn.Module], optimizer, seed: int) -> None:
    """One step of the whole model or its two stages (the tied copies' gradients summed,
    as the pipeline step sums them)."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 256, (2, 16), generator=gen), torch.randint(0, 256, (2, 16), generator=gen)
    smoothed_loss(_chain(parts, x), y).backward()
    if len(parts) == 2:
        sync_tied_grads([(parts[0].tok_emb.weight, parts[1].head.weight)], None)
    optimizer.step()
    optimizer.zero_grad()


def _stages_and_optimizer(seed: int):
    torch.manual_seed(seed)
    stages = _stages(UserLM(tie=True), 2)
    return stages, torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=0.01)


def _whole_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = UserLM(tie=True)
    return [model], torch.optim.AdamW(model.parameters(), lr=0.01)


def _same(a: list[nn.Module], b: list[nn.Module]) -> bool:
    mine = {k: v for part in a for k, v in part.state_dict().items()}
    theirs = {k: v for part in b for k, v in part.state_dict().items()}
    return mine.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in mine.items())


@pytest.mark.parametrize("written_by", ["whole", "stages"])
def test_a_tied_heads_copy_resumes_across_the_split_both_ways(tmp_path: Path, written_by):
    """The whole model's checkpoint loads into its two stages (the head's copy takes the
    embedding's weights and optimizer state, kept under the embedding's name) and theirs
    into the whole model: two more steps either way are one run's, to the bit."""
    make = {"whole": _whole_and_optimizer, "stages": _stages_and_optimizer}
    other = "stages" if written_by == "whole" else "whole"
    ref, ref_opt = make[written_by](0)
    _step(ref, ref_opt, 1)
    _save(ref, ref_opt, tmp_path / "ckpt")
    if written_by == "stages":  # the copy's optimizer state goes by the embedding's name
        keys = set(OptimizerState(ref[1:], ref_opt).state_dict())
        assert "state.tok_emb.weight.exp_avg" in keys and not any("head" in k for k in keys)
    again, again_opt = make[other](7)
    _load(again, again_opt, tmp_path / "ckpt")
    for seed in (2, 3):
        _step(ref, ref_opt, seed)
        _step(again, again_opt, seed)
    assert _same(ref, again)


# -- the meta build keeps a tie; a stage's tensor-parallel plan ------------------------------


def test_a_meta_built_model_keeps_its_tie_through_allocation():
    with torch.device("meta"):
        model = UserLM(tie=True)
    allocate(model, torch.device("cpu"))
    assert model.head.weight is model.tok_emb.weight
    assert [n for n, _ in model.named_parameters()].count("head.weight") == 0


def test_a_stage_keeps_the_plan_entries_of_its_own_modules():
    plans = [{"layers.*.qkv": ColwiseParallel(), "layers.*.out": RowwiseParallel(),
              "tok_emb": RowwiseParallel(), "head": ColwiseParallel()}]
    first, last = _stages(UserLM(), 2)
    assert list(held_plans(plans, first)[0]) == ["layers.*.qkv", "layers.*.out", "tok_emb"]
    assert list(held_plans(plans, last)[0]) == ["layers.*.qkv", "layers.*.out", "head"]


# -- refused, one line each, before any worker -----------------------------------------------

BAD = '''
import torch
from torch import nn
import torch.nn.functional as F


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 8)
        self.trunk = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 256)

    def forward(self, x):
        h = self.emb(x)
        for b in self.trunk:
            h = b(h)
        return self.head(h)


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 256)


class Intolerant(Base):
    def forward(self, x):
        h = self.emb(x)  # a stage without the embedding (or the head) fails
        for b in self.layers:
            h = b(h)
        return self.head(h)


class OutOfOrder(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)  # registered before the blocks, used after them
        self.emb = nn.Embedding(256, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 256)

    def forward(self, x):
        h = self.emb(x) if self.emb is not None else x
        for b in self.layers:
            h = b(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


class OwnParameter(Base):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(8))

    def forward(self, x):
        h = self.emb(x) + self.pos
        for b in self.layers:
            h = b(h)
        return self.head(h)


class SharedAcrossBlocks(Base):
    def __init__(self):
        super().__init__()
        self.layers[1].weight = self.layers[0].weight


def build(kind):
    return globals()[kind]()
'''


@pytest.fixture
def bad_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "bad_models.py").write_text(BAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("bad_models", None)


def _problems(name: str, *keys: str) -> list[str]:
    cfg = load_config(overrides=[
        f"model.name='{name}'", "data.seq_len=16", "parallel.pp=2", "parallel.strategy='ddp'",
        "data.micro_batch=4", *keys,
    ])
    with pytest.raises(ConfigError) as err:
        prepare_job(cfg, 2, CPU, 2)
    assert all("\n" not in p for p in err.value.problems)
    return err.value.problems


@pytest.mark.parametrize(("kind", "said"), [
    ("NoBlocks", "has no blocks to cut into stages: keep its repeated blocks in a "
                 "ModuleList, ModuleDict or Sequential named `layers` or `blocks`"),
    ("Intolerant", "stage 0 of 2 fails on the meta device (TypeError: 'NoneType' object is "
                   "not callable)"),
    ("OutOfOrder", "registers `norm` before `layers` but its forward calls it after them"),
    ("OwnParameter", "parameter 'pos' belongs to the model itself"),
    ("SharedAcrossBlocks", "parameter 'layers.0.weight' is also 'layers.1.weight'"),
])
def test_a_module_that_cannot_be_cut_is_refused_in_one_line(bad_models, kind, said):
    (problem,) = _problems("bad_models:build", f"model.kwargs={{kind = '{kind}'}}")
    assert problem.startswith("parallel.pp = 2: model.name = 'bad_models:build'")
    assert said in problem and "or use parallel.pp = 1" in problem


def test_stages_that_do_not_divide_the_blocks_are_refused():
    (problem,) = _problems("user_lm:build", "model.kwargs={n_blocks = 3}")
    assert "2 stages divide neither the model's 3 layers nor 3 + 2" in problem


def test_auto_is_refused_until_the_planner_cuts_your_module():
    (problem,) = _problems("user_lm:build", "parallel.strategy='auto'")
    assert "parallel.strategy = 'auto'" in problem and "set parallel.strategy = 'fsdp'" in problem


def test_a_batch_with_more_inputs_than_one_is_refused_in_stages():
    """The counted dataset hands the model its samples' ids beside the input: in stages
    they could reach the first stage alone."""
    (problem,) = _problems("user_job:build", "data.dataset='user_job:map_counted'",
                           "data.global_batch=4")
    assert problem.startswith("parallel.pp = 2: model.name = 'user_job:build'")
    assert "data.dataset = 'user_job:map_counted' give the model 1 more input(s)" in problem
    assert problem.endswith("or use parallel.pp = 1")


def test_a_module_that_follows_the_convention_is_accepted():
    cfg = load_config(overrides=[
        "model.name='user_lm:build'", "model.kwargs={tie = true}", "data.seq_len=16",
        "parallel.pp=2", "parallel.strategy='ddp'", "data.micro_batch=4",
    ])
    assert prepare_job(cfg, 2, CPU, 2).dims.pp == 2
    # The tests' own classifier on its own data (tests/user_job.py), two inputs no more.
    cfg = load_config(overrides=[
        "model.name='user_job:build'", "data.dataset='user_job:map_data'", "parallel.pp=2",
        "parallel.strategy='ddp'", "data.micro_batch=8", "data.global_batch=8",
    ])
    assert prepare_job(cfg, 2, CPU, 2).dims.pp == 2
