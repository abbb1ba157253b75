"""The model-converter seam: factories selected by config, applied in order before the
model is parallelized, and post-optimizer hooks called by the step; the job's mesh
answers which share of the data a rank reads."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainwise.config import load_config
from trainwise.config.parallel_dims import ParallelDims
from trainwise.hardware import GB, DeviceInfo
from trainwise.models import converters
from trainwise.models.converters import build_converters, convert, post_optimizer_hooks
from trainwise.run.engine.mesh import job_mesh
from trainwise.run.engine.step import DataParallelStep
from trainwise.run.engine.trainer import build_trainer
from trainwise.run.job.resolve import prepare_job

CPU = DeviceInfo("cpu", "cpu", 1, 64 * GB, bf16=True, fp16=False, gpu=None)


class Recorder:
    """A converter that notes the order it ran in, and keeps a post-optimizer hook."""

    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def convert(self, model: torch.nn.Module) -> None:
        self.log.append(f"convert {self.name}")

    def post_optimizer_hook(self, parts: list[torch.nn.Module]) -> None:
        self.log.append(f"hook {self.name} on {len(parts)} part(s)")


class Plain:
    name = "plain"

    def convert(self, model: torch.nn.Module) -> None:
        pass


@pytest.fixture
def registry(monkeypatch):
    """An empty CONVERTERS for the test (features may have registered theirs)."""
    found: list = []
    monkeypatch.setattr(converters, "CONVERTERS", found)
    return found


def test_factories_select_by_config_in_their_order(registry):
    log: list[str] = []
    registry.append(lambda cfg: Recorder("a", log) if cfg.train.steps > 5 else None)
    registry.append(lambda cfg: None)  # a feature the job did not ask for
    registry.append(lambda cfg: Recorder("b", log))
    chosen = build_converters(load_config(overrides=["train.steps=10"]))
    assert [c.name for c in chosen] == ["a", "b"]
    assert [c.name for c in build_converters(load_config(overrides=["train.steps=3"]))] == ["b"]
    convert(torch.nn.Linear(2, 2), chosen)
    assert log == ["convert a", "convert b"]


def test_no_converter_is_asked_for_by_default():
    assert build_converters(load_config()) == []


def test_the_step_calls_post_optimizer_hooks_after_the_update():
    log: list[str] = []
    hooks = post_optimizer_hooks([Recorder("a", log), Plain()])
    assert len(hooks) == 1  # Plain has none
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()

    def hook(parts):
        log.append("moved" if not torch.equal(parts[0].weight, before) else "not moved")

    step = DataParallelStep(
        torch.nn.functional.cross_entropy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1),
        None, nullcontext, 1, 1.0, torch.device("cpu"), after_optimizer=[*hooks, hook],
    )
    step.step([model], iter([(torch.randn(2, 4), torch.tensor([0, 1]))]), probe=False)
    assert log == ["hook a on 1 part(s)", "moved"]


class Doubled(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


class DoubleLinears:
    """Changes what the model computes: proves the converted model is the one trained."""

    name = "double"

    def convert(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.__class__ = Doubled


def first_loss(registry: list, converter: object | None) -> tuple[float, list[str]]:
    registry[:] = [lambda cfg: converter] if converter else []
    cfg = load_config(overrides=[
        "model.name='tiny'", "data.seq_len=16", "data.synthetic_tokens=4000",
        "parallel.strategy='single'", "data.micro_batch=2", "checkpoint.enabled=false",
    ])
    job = prepare_job(cfg, 1, CPU)
    trainer = build_trainer(cfg, job, torch.device("cpu"))
    x = torch.randint(0, job.model_spec.vocab_size or 64, (2, 16))
    result = trainer.train_step(iter([(x, x)]))
    names = [n for part in trainer.parts for n, _ in part.named_parameters()]
    return float(result.loss), names


def test_the_trainer_builds_the_converted_model_with_the_same_names(registry):
    plain, names = first_loss(registry, None)
    doubled, converted_names = first_loss(registry, DoubleLinears())
    assert converted_names == names  # checkpoint keys do not change
    assert doubled != pytest.approx(plain)


@pytest.mark.parametrize(
    ("dims", "expected"),
    [
        (ParallelDims.from_strategy("fsdp", 8, tp=2), [0, 0, 1, 1, 2, 2, 3, 3]),
        (ParallelDims.from_strategy("hsdp", 8, replicate=2), list(range(8))),
        (ParallelDims.from_strategy("hsdp", 8, replicate=2, tp=2), [0, 0, 1, 1, 2, 2, 3, 3]),
        (ParallelDims.from_strategy("ddp", 4), [0, 1, 2, 3]),
        (ParallelDims.from_strategy("single", 2, tp=2), [0, 0]),
    ],
)
def test_the_mesh_says_which_share_of_the_data_a_rank_reads(dims, expected):
    ranks = []
    for rank in range(dims.world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world)
        try:
            mesh = job_mesh(dims, "cpu")
            ranks.append(mesh.dp_rank)
            assert mesh.dp_size == dims.dp_size
        finally:
            dist.destroy_process_group()
    assert ranks == expected
