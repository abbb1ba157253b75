"""Python objects as job keys (trainwise.objects): an importable object by its import path,
any other by value (cloudpickle, a file named by its content) under a reference that is the
same in every process, so that a rerun's lineage matches; what cannot travel is one typed
line before any worker starts."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers import cli_env, hang_limit
from trainwise.api import data_key, function_key, model_key
from trainwise.config import load_config
from trainwise.errors import ConfigError, DataError, ModelError
from trainwise.objects import (
    OBJECTS_ENV,
    import_path_of,
    is_pickled_reference,
    load_callable,
    load_object,
    object_reference,
    objects_dir,
)
from trainwise.records import JobRecord

# A script whose model factory and module class live in its __main__ (what a user's
# training script or a notebook holds): it prints the references trainwise makes of them.
SCRIPT = '''
import sys
import torch
from torch import nn

VOCAB = 97

class Net(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))

    def forward(self, x):
        return self.embed(x)

def build(width: int = 8):
    return Net(width)

if __name__ == "__main__":
    from trainwise.api import model_key
    print(model_key(build), model_key(Net))
'''


def test_an_importable_object_is_named_by_its_import_path():
    assert import_path_of(JobRecord) == "trainwise.records:JobRecord"
    assert model_key(JobRecord) == "trainwise.records:JobRecord"
    assert function_key(load_config, "loss") == "trainwise.config.load:load_config"
    assert model_key("tiny") == "tiny" and data_key("synthetic") == "synthetic"


def test_a_local_object_travels_by_value_and_comes_back(tmp_path: Path):
    def build(width: int = 3) -> list[int]:
        return [width] * width

    ref = model_key(build)
    assert is_pickled_reference(ref)
    assert (objects_dir() / f"{ref.removeprefix('pickled:')}.pkl").is_file()
    assert load_callable(ref, "model.name")(2) == [2, 2]
    assert model_key(build) == ref  # the same object, the same reference
    # A job key that takes it: the schema accepts the reference where it takes a path.
    cfg = load_config(overrides=[f"data.dataset={data_key(build)}", f"model.name={ref}"])
    assert cfg.data.dataset.startswith("pickled:")


def test_the_reference_is_the_same_in_every_process(tmp_path: Path):
    """Classes pickled by value carry an id that cloudpickle draws at random in each
    process: trainwise makes it a digest, so a rerun of the same script (string hashing
    seeded differently) gives the same references and its checkpoints resume."""
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
    refs = []
    for seed in ("1", "2"):
        env = {**cli_env(), "PYTHONHASHSEED": seed, OBJECTS_ENV: str(tmp_path / "objects")}
        done = subprocess.run(
            [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True,
            text=True, timeout=hang_limit(),
        )
        assert done.returncode == 0, done.stderr
        refs.append(done.stdout.split())
    assert refs[0] == refs[1] and len(refs[0]) == 2
    assert all(is_pickled_reference(ref) for ref in refs[0]) and refs[0][0] != refs[0][1]
    assert len(list((tmp_path / "objects").glob("*.pkl"))) == 2


def test_an_object_that_cannot_travel_is_one_typed_line():
    lock = threading.Lock()

    def build() -> object:
        return lock  # a lock cannot be pickled

    with pytest.raises(ModelError) as err:
        model_key(build)
    text = str(err.value)
    assert "\n" not in text and text.startswith("model: ")
    assert "cannot be sent to the workers" in text and "importable module" in text
    with pytest.raises(DataError, match="^data: "):
        data_key(lambda: lock)


def test_a_reference_whose_file_is_gone_is_one_line(tmp_path: Path, monkeypatch):
    ref = object_reference(lambda: 1, "model")
    monkeypatch.setenv(OBJECTS_ENV, str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError) as err:
        load_object(ref, "model.name")
    assert "no such object in" in str(err.value) and OBJECTS_ENV in str(err.value)


def test_an_unwritable_objects_folder_is_one_line(tmp_path: Path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(OBJECTS_ENV, str(blocker / "objects"))  # under a file: cannot exist
    with pytest.raises(ConfigError, match=f"cannot keep .* set {OBJECTS_ENV}"):
        object_reference(lambda: 2, "collate")
