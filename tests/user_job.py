"""A user's own job, as the tests of your own model and dataset name it: a plain nn.Module
(not trainwise's GPT) and datasets in the forms data.dataset takes, by import paths
"user_job:ATTR". Worker processes import it too: launch with `user_env(folder)`, which
puts tests/ on PYTHONPATH and says where the data lies (write_jsonl made it there).

Samples: FEATURES floats and a class out of CLASSES that a linear map of them decides
(learnable), each with its id (0..SAMPLES-1). The *_counted datasets hand the id to the
model as a second input, and the model writes the ids it trains on to DIR/seen/PID.txt:
what a test counts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

FEATURES, CLASSES, SAMPLES, VAL_SAMPLES = 8, 4, 512, 64
DIR_ENV = "USER_JOB_DIR"  # where the JSONL files lie and the seen ids go


def features(i: int) -> list[float]:
    rng = np.random.default_rng([7, i])
    return [round(float(v), 4) for v in rng.standard_normal(FEATURES)]  # exact in JSON


_W = np.random.default_rng(3).standard_normal((CLASSES, FEATURES))


def label(x: list[float]) -> int:
    return int(np.argmax(_W @ np.asarray(x)))


def row(i: int) -> dict[str, Any]:
    x = features(i)
    return {"x": x, "label": label(x), "id": i}


def write_jsonl(folder: Path) -> Path:
    """DIR/train.jsonl (ids 0..SAMPLES-1) and DIR/val.jsonl (the next VAL_SAMPLES)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, ids in (("train", range(SAMPLES)), ("val", range(SAMPLES, SAMPLES + VAL_SAMPLES))):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row(i)) + "\n" for i in ids))
    return folder


def user_env(folder: Path) -> dict[str, str]:
    """The environment of a run of this job: tests/ importable, the data folder, no hub."""
    tests = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, DIR_ENV: str(folder), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1"}


def _dir() -> Path:
    return Path(os.environ[DIR_ENV])


# -- the model ---------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class UserNet(nn.Module):
    """A small residual classifier; `ids` (the counted datasets): recorded, not used.
    Written as docs/parallelism.md tells a user to, so that it runs in pipeline stages
    too: the blocks in `blocks`, and a forward that skips what a stage lacks (None)."""

    def __init__(self, width: int = 32, depth: int = 2):
        super().__init__()
        self.embed = nn.Linear(FEATURES, width)  # the first stage's
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, CLASSES)  # the last stage's

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        if ids is not None and self.training:
            record(ids)
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            h = block(h)
        return self.head(h) if self.head is not None else h


def build() -> UserNet:
    return UserNet()


def record(ids: torch.Tensor) -> None:
    seen = _dir() / "seen"
    seen.mkdir(exist_ok=True)
    with (seen / f"{os.getpid()}.txt").open("a") as f:
        f.write("".join(f"{int(i)}\n" for i in ids))


def seen_ids(folder: Path) -> list[int]:
    """Every id the model trained on, over all processes (repeats kept)."""
    return [int(x) for p in (folder / "seen").glob("*.txt") for x in p.read_text().split()]


# -- the datasets ------------------------------------------------------------------------


class MapSamples(Dataset):
    """Map-style: sample i is (x, label) or, counted, (x, label, id)."""

    def __init__(self, counted: bool = False, n: int = SAMPLES):
        self.counted, self.n = counted, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        r = row(int(i))
        x, y = torch.tensor(r["x"]), torch.tensor(r["label"])
        return (x, y, torch.tensor(i)) if self.counted else (x, y)


def map_data() -> MapSamples:
    return MapSamples()


def map_counted() -> MapSamples:
    return MapSamples(counted=True)


def _quiet() -> None:
    import datasets

    datasets.disable_progress_bars()


def hf_data() -> Any:
    """A Hugging Face DatasetDict (train, validation) from the JSONL files: map-style."""
    import datasets

    _quiet()
    files = {"train": str(_dir() / "train.jsonl"), "validation": str(_dir() / "val.jsonl")}
    return datasets.load_dataset(
        "json", data_files=files, cache_dir=str(_dir() / "hf-cache")
    ).remove_columns("id")


def hf_stream() -> Any:
    """The same files streamed: an IterableDatasetDict (train, validation)."""
    import datasets

    _quiet()
    files = {"train": str(_dir() / "train.jsonl"), "validation": str(_dir() / "val.jsonl")}
    return datasets.load_dataset("json", data_files=files, streaming=True).remove_columns("id")


def hf_stream_counted() -> Any:
    """The training file streamed with its ids, no validation split."""
    import datasets

    _quiet()
    return datasets.load_dataset(
        "json", data_files=str(_dir() / "train.jsonl"), split="train", streaming=True
    )


# -- bad input, one object each ----------------------------------------------------------


class Strings(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> str:
        return f"sample {i}"


strings = Strings()


def no_tensors(samples: list[Any]) -> dict[str, Any]:
    """A collate that returns no tensors."""
    return {"x": [s[0].tolist() for s in samples], "labels": [int(s[1]) for s in samples]}


def too_short() -> MapSamples:
    return MapSamples(n=10)


def raises() -> MapSamples:
    raise RuntimeError("the bucket is not mounted")
