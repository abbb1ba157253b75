"""Unit tests of checkpoint export and listing, in one process without torch.distributed:
real DCP checkpoints of a tiny GPT (committed by checkpoint_store) are exported to
safetensors and torch files that a fresh plain model loads strictly and runs bit for bit
like the trained one; resolve_checkpoint's choices and errors; `trainwise export` and
`trainwise checkpoints` through the dispatcher."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
)

import trainwise
from trainwise.cli.checkpoints import collect
from trainwise.cli.main import main
from trainwise.config import dump_toml, load_config
from trainwise.errors import ConfigError
from trainwise.export.hf import export_hf
from trainwise.export.weights import (
    ExportIOError,
    checkpoint_root,
    export_weights,
    load_model_state,
    resolve_checkpoint,
)
from trainwise.models.gpt import GPT
from trainwise.models.registry import ModelSpec, build_model, resolve_shape
from trainwise.run.checkpoint.store import (
    CheckpointError,
    commit,
    config_hash,
    final_dir,
    tmp_dir,
)

SPEC = ModelSpec(name="tiny", vocab_size=64, seq_len=16)


def batch(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (4, 16), generator=g)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    model.train()
    for i in range(steps):
        x = batch(100 + i)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def save_checkpoint(root: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> Path:
    """What the trainer writes for one rank: DCP state, trainer.json, rng, then commit."""
    tmp = tmp_dir(root, step)
    tmp.mkdir(parents=True)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ..." (on purpose)
        dcp.save(state, checkpoint_id=tmp)
    trainer = {"step": step, "tokens": step * 64, "strategy": "single", "world_size": 1}
    (tmp / "trainer.json").write_text(json.dumps(trainer))
    (tmp / "rng").mkdir()
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng" / "rank-00000.pt")
    commit(
        tmp,
        final_dir(root, step),
        {
            "step": step,
            "tokens": step * 64,
            "world_size": 1,
            "dp_size": 1,
            "strategy": "single",
            "config_hash": config_hash("test"),
            "trainwise_version": trainwise.__version__,
            "torch_version": torch.__version__,
            "step_time": time.time(),
            "stall_s": 0.25,
            "save_s": 0.5,
            "async_save": False,
        },
    )
    return final_dir(root, step)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run directory with checkpoints of steps 2 and 4 of a tiny GPT trained with AdamW,
    and the trained model's logits on a fixed batch at each step."""
    run = tmp_path_factory.mktemp("run")
    (run / "config.toml").write_text(dump_toml(load_config()))
    torch.manual_seed(0)
    model = build_model(SPEC).module
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = {}
    for step in (2, 4):
        train_steps(model, opt, 2)
        with torch.no_grad():
            expected[step] = model(batch())
        save_checkpoint(run / "checkpoints", step, model, opt)
    return {"run": run, "expected": expected, "keys": sorted(model.state_dict())}


@pytest.fixture
def run_copy(trained: dict, tmp_path: Path) -> Path:
    """A private copy of the run, for tests that break or add things."""
    return Path(shutil.copytree(trained["run"], tmp_path / "run"))


def fresh_model(seed: int = 123) -> nn.Module:
    torch.manual_seed(seed)  # different weights from the trained ones until loaded
    return build_model(SPEC).module.eval()


# --- loading and export ----------------------------------------------------------------------


def test_load_model_state_is_the_plain_state_dict(trained: dict):
    ckpt = final_dir(trained["run"] / "checkpoints", 4)
    state = load_model_state(ckpt)
    assert sorted(state) == trained["keys"]  # "model." prefix gone, no optimizer state
    assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in state.values())
    # tiny ties the head to the embedding: one tensor, no lm_head entry.
    assert resolve_shape(SPEC).tie_embeddings
    assert "lm_head.weight" not in state and "tok_emb.weight" in state


@pytest.mark.parametrize("fmt, name", [("safetensors", "m.safetensors"), ("torch", "m.pt")])
def test_export_loads_strictly_and_matches_bit_for_bit(
    trained: dict, tmp_path: Path, fmt: str, name: str
):
    ckpt = final_dir(trained["run"] / "checkpoints", 2)
    out = tmp_path / "sub" / name
    result = export_weights(ckpt, out, fmt)
    assert result == {"tensors": len(trained["keys"]), "bytes": out.stat().st_size, "step": 2}
    assert not out.with_suffix(out.suffix + ".part").exists()

    if fmt == "safetensors":
        loaded = load_file(out)
        with safe_open(out, framework="pt") as f:
            assert f.metadata() == {"step": "2", "format": "trainwise"}
    else:
        loaded = torch.load(out, weights_only=True)
    model = fresh_model()
    with torch.no_grad():
        assert not torch.equal(model(batch()), trained["expected"][2])
        model.load_state_dict(loaded, strict=True)
        assert torch.equal(model(batch()), trained["expected"][2])


def test_export_untied_gpt(tmp_path: Path):
    shape = replace(resolve_shape(SPEC), tie_embeddings=False)
    torch.manual_seed(0)
    model = GPT(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, 2)
    ckpt = save_checkpoint(tmp_path / "ckpts", 2, model, opt)
    export_weights(ckpt, tmp_path / "m.safetensors", "safetensors")
    loaded = load_file(tmp_path / "m.safetensors")
    assert "lm_head.weight" in loaded
    torch.manual_seed(1)
    fresh = GPT(shape).eval()
    fresh.load_state_dict(loaded, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(batch()), model(batch()))


class SharedHead(nn.Module):
    """Classic weight tying: two module entries share one Parameter, so state_dict() has two
    keys over one storage (safetensors refuses that unless export makes them independent)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.head = nn.Linear(8, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def test_export_shared_parameters(tmp_path: Path):
    torch.manual_seed(0)
    model = SharedHead()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, 2)
    ckpt = save_checkpoint(tmp_path / "ckpts", 2, model, opt)
    for fmt, name in (("safetensors", "m.safetensors"), ("torch", "m.pt")):
        export_weights(ckpt, tmp_path / name, fmt)
        loaded = (
            load_file(tmp_path / name)
            if fmt == "safetensors"
            else torch.load(tmp_path / name, weights_only=True)
        )
        assert sorted(loaded) == sorted(model.state_dict())
        fresh = SharedHead().eval()
        fresh.load_state_dict(loaded, strict=True)
        with torch.no_grad():
            assert torch.equal(fresh(batch()), model(batch()))


def test_export_of_a_broken_checkpoint_is_one_line(run_copy: Path, tmp_path: Path):
    ckpt = final_dir(run_copy / "checkpoints", 4)
    (ckpt / "__0_0.distcp").write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as err:
        export_weights(ckpt, tmp_path / "m.safetensors", "safetensors")
    assert "\n" not in str(err.value) and str(ckpt) in str(err.value)
    assert not list(tmp_path.glob("m.safetensors*"))
    with pytest.raises(CheckpointError, match="no .metadata"):
        export_weights(run_copy, tmp_path / "m.safetensors", "safetensors")


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_write_that_fails_midway_leaves_nothing(
    trained: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
):
    """A full disk during the write: one line naming -o, an I/O fault (exit 1, as a full
    disk in training), and no file that looks complete."""

    def half_then_fail(_tensors: object, path: object, **_: object) -> None:
        Path(path).write_bytes(b"half a file")
        raise RuntimeError("I/O error: No space left on device (os error 28)")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_fail)
    monkeypatch.setattr(torch, "save", half_then_fail)
    out = tmp_path / f"m.{fmt}"
    with pytest.raises(ExportIOError) as err:
        export_weights(resolve_checkpoint(trained["run"], None), out, fmt)
    line = str(err.value)
    assert "\n" not in line and f"-o {out}" in line and "no space left" in line
    assert err.value.exit_status == 1
    assert list(tmp_path.iterdir()) == []


# --- resolve_checkpoint ----------------------------------------------------------------------


def test_resolve_newest_and_by_step(trained: dict):
    run, root = trained["run"], trained["run"] / "checkpoints"
    assert checkpoint_root(run) == root
    assert resolve_checkpoint(run, None) == final_dir(root, 4)
    assert resolve_checkpoint(run, 2) == final_dir(root, 2)
    assert resolve_checkpoint(root, None) == final_dir(root, 4)  # a checkpoint root works too
    assert resolve_checkpoint(final_dir(root, 2), None) == final_dir(root, 2)
    assert resolve_checkpoint(final_dir(root, 2), 2) == final_dir(root, 2)


def test_resolve_skips_a_corrupted_newer_checkpoint(run_copy: Path):
    root = run_copy / "checkpoints"
    shard = final_dir(root, 4) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: fast verification sees it
    assert resolve_checkpoint(run_copy, None) == final_dir(root, 2)
    with pytest.raises(CheckpointError, match="step 4 .* not valid") as err:
        resolve_checkpoint(run_copy, 4)
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="not valid"):
        resolve_checkpoint(final_dir(root, 4), None)


def test_resolve_errors_are_one_line(run_copy: Path, tmp_path: Path):
    with pytest.raises(CheckpointError, match=r"steps available: 2, 4") as err:
        resolve_checkpoint(run_copy, 3)
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="is the checkpoint of step 2, not 4"):
        resolve_checkpoint(final_dir(run_copy / "checkpoints", 2), 4)
    with pytest.raises(CheckpointError, match="not a directory"):
        resolve_checkpoint(tmp_path / "nope", None)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no checkpoints in"):
        resolve_checkpoint(empty, None)
    for step in (2, 4):
        (final_dir(run_copy / "checkpoints", step) / "manifest.json").unlink()
    with pytest.raises(
        CheckpointError, match=r"no valid checkpoint .* all 2 are broken \(newest, step 4: "
    ):
        resolve_checkpoint(run_copy, None)


def test_resolve_follows_config_checkpoint_dir(trained: dict, tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(trained["run"] / "checkpoints", elsewhere)
    cfg = load_config(flags={"checkpoint.dir": str(elsewhere)})
    (run / "config.toml").write_text(dump_toml(cfg))
    assert checkpoint_root(run) == elsewhere
    assert resolve_checkpoint(run, None) == final_dir(elsewhere, 4)


# --- from Python: trainwise.export ------------------------------------------------------------


def test_trainwise_export_is_the_commands_export_as_a_record(trained: dict, tmp_path: Path):
    import trainwise
    from trainwise.errors import ConfigError

    done = trainwise.export(trained["run"], tmp_path / "w.safetensors", step=2)
    assert (done.format, done.step, done.path) == ("safetensors", 2, tmp_path / "w.safetensors")
    assert done.tensors == len(trained["keys"]) and done.bytes == done.path.stat().st_size
    model = fresh_model()
    model.load_state_dict(load_file(done.path), strict=True)
    with torch.no_grad():
        assert torch.equal(model(batch()), trained["expected"][2])
    assert main(["export", str(trained["run"]), "--step", "2", "-o", str(tmp_path / "c.safetensors")]) == 0
    assert load_file(tmp_path / "c.safetensors").keys() == load_file(done.path).keys()
    with pytest.raises(ConfigError, match="output= .*w.txt: cannot tell the format"):
        trainwise.export(trained["run"], tmp_path / "w.txt")
    with pytest.raises(ConfigError, match="format hf writes a directory"):
        trainwise.export(trained["run"], format="hf")


# --- the CLI ---------------------------------------------------------------------------------


def test_cli_export_default_output(run_copy: Path, capsys: pytest.CaptureFixture):
    assert main(["export", str(run_copy)]) == 0
    out = run_copy / "model-step-00000004.safetensors"
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and str(out) in line and "tensors" in line and "MB" in line
    assert "step 4" in line
    model = fresh_model()
    model.load_state_dict(load_file(out), strict=True)


def test_cli_export_step_and_torch_format(
    trained: dict, tmp_path: Path, capsys: pytest.CaptureFixture
):
    out = tmp_path / "w.pth"
    assert main(["export", str(trained["run"]), "--step", "2", "-o", str(out)]) == 0
    assert "step 2" in capsys.readouterr().out
    model = fresh_model()
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    with torch.no_grad():
        assert torch.equal(model(batch()), trained["expected"][2])
    # --format wins over the suffix.
    odd = tmp_path / "w.bin"
    assert main(["export", str(trained["run"]), "--format", "safetensors", "-o", str(odd)]) == 0
    assert sorted(load_file(odd)) == trained["keys"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["export", "{missing}"], "no such run directory"),
        (["export", "{run}", "--step", "3"], "steps available: 2, 4"),
        (["export", "{run}", "-o", "{tmp}/w.txt"], "cannot tell the format"),
        # /proc takes no new files on Linux: an output that cannot be written.
        (["export", "{run}", "-o", "/proc/x.safetensors"], "cannot write a file in /proc"),
        (["export", "{run}", "-o", "/proc/x.pt"], "-o /proc/x.pt: cannot write"),
        (["export", "{run}", "--format", "torch", "-o", "{tmp}"], "is a directory: give a file"),
        (["checkpoints", "{missing}"], "no such run directory"),
        (["checkpoints", "{tmp}"], "no checkpoints in"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(
    trained: dict, tmp_path: Path, capsys: pytest.CaptureFixture, args: list, message: str
):
    paths = {"missing": tmp_path / "nope", "run": trained["run"], "tmp": tmp_path}
    assert main([a.format(**paths) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("trainwise: error: ") and message in err


def test_cli_checkpoints_json(run_copy: Path, capsys: pytest.CaptureFixture):
    root = run_copy / "checkpoints"
    broken = final_dir(root, 4) / "__0_0.distcp"
    broken.write_bytes(b"x" * broken.stat().st_size)  # same size: only full verify sees it
    (root / "step-00000006.tmp").mkdir()
    (root / "step-00000006.tmp" / "__0_0.distcp").write_bytes(b"partial")

    assert main(["checkpoints", str(run_copy), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"], r["valid"]) for r in rows] == [
        (2, "complete", True),
        (4, "complete", True),
        (6, "incomplete", False),
    ]
    first = rows[0]
    for key in ("path", "created", "time", "bytes", "tokens", "world_size", "dp_size"):
        assert first[key] is not None, key
    assert (first["strategy"], first["async_save"], first["stall_s"], first["save_s"]) == (
        "single",
        False,
        0.25,
        0.5,
    )
    assert first["problems"] == [] and first["bytes"] > 0
    assert rows[2]["problems"] == ["incomplete (ignored)"] and rows[2]["bytes"] == 7

    # The newest (step 4) is invalid, step 2 is valid: exit status 3 for scripts.
    assert main(["checkpoints", str(final_dir(root, 2)), "--json", "--verify", "full"]) == 3
    rows = json.loads(capsys.readouterr().out)
    assert [r["valid"] for r in rows] == [True, False, False]
    assert "xxh3 mismatch" in rows[1]["problems"][0]


def test_cli_checkpoints_table(
    run_copy: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("COLUMNS", "100")  # rich's width when stdout is not a terminal
    root = run_copy / "checkpoints"
    shard = final_dir(root, 4) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])
    (root / "step-00000006.tmp").mkdir()
    assert main(["checkpoints", str(run_copy)]) == 3  # the newest is invalid, not step 2
    lines = capsys.readouterr().out.splitlines()
    assert str(root) in lines[0]
    rows = {line.split()[0]: line for line in lines if line.strip()[:1].isdigit()}
    assert "✓" in rows["2"] and "single" in rows["2"] and "0.25" in rows["2"]
    assert "✗" in rows["4"] and "incomplete (ignored)" in rows["6"]
    # The first problem of the broken one, under the table, its path relative to the step.
    assert lines[-1].strip().startswith("step 4: ✗ __0_0.distcp: 10 bytes")


def test_independent_tensors_satisfy_safetensors(tmp_path: Path):
    """Tied weights, views into a larger buffer and non-contiguous tensors all become
    contiguous tensors owning their memory, with the same values."""
    from safetensors.torch import save_file

    from trainwise.export.weights import _independent

    base = torch.arange(12.0).reshape(3, 4)
    tensors = {"a": base, "b": base, "c": base[1:], "d": base.t(), "e": torch.empty(0)}
    fixed = _independent(tensors)
    save_file(fixed, str(tmp_path / "x.safetensors"))
    loaded = load_file(tmp_path / "x.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name


def test_export_keeps_bf16(tmp_path: Path):
    torch.manual_seed(0)
    model = SharedHead().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, 1)
    ckpt = save_checkpoint(tmp_path / "ckpts", 1, model, opt)
    export_weights(ckpt, tmp_path / "m.safetensors", "safetensors")
    loaded = load_file(tmp_path / "m.safetensors")
    assert {t.dtype for t in loaded.values()} == {torch.bfloat16}
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_export_dtype_writes_the_weights_rounded_to_it(
    trained: dict, tmp_path: Path, dtype: str, torch_dtype: torch.dtype
):
    ckpt = final_dir(trained["run"] / "checkpoints", 2)
    export_weights(ckpt, tmp_path / "m.safetensors", "safetensors", dtype=dtype)
    loaded, state = load_file(tmp_path / "m.safetensors"), load_model_state(ckpt)
    assert {t.dtype for t in loaded.values()} == {torch_dtype}
    assert all(torch.equal(loaded[k], v.to(torch_dtype)) for k, v in state.items())


def test_cli_export_dtype_is_checked_by_the_parser_and_the_api(
    trained: dict, tmp_path: Path, capsys: pytest.CaptureFixture
):
    from trainwise.api.exporting import export

    with pytest.raises(SystemExit) as parsed:
        main(["export", str(trained["run"]), "--dtype", "int8", "-o", str(tmp_path / "m.pt")])
    assert parsed.value.code == 2 and "--dtype" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="is not one an export writes"):
        export(trained["run"], tmp_path / "m.safetensors", dtype="fp8")  # type: ignore[arg-type]
    assert not (tmp_path / "m.safetensors").exists()


def test_cli_export_of_a_checkpoint_dir_writes_to_the_cwd(
    trained: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    monkeypatch.chdir(tmp_path)
    ckpt = final_dir(trained["run"] / "checkpoints", 2)
    assert main(["export", str(ckpt), "--format", "torch"]) == 0
    assert (tmp_path / "model-step-00000002.pt").is_file()
    assert "model-step-00000002.pt" in capsys.readouterr().out
    assert not list(ckpt.glob("model-*"))  # the checkpoint itself stays as committed


# --- trust nothing unverified ----------------------------------------------------------------


def flip_byte_of(path: Path, tensor: torch.Tensor) -> None:
    """Flip one byte inside the stored bytes of `tensor` (its first value), keeping the size:
    only a checksum sees it."""
    data = bytearray(path.read_bytes())
    at = data.find(tensor.detach().contiguous().numpy().tobytes()[:16])
    assert at >= 0, "the tensor's bytes are not in the shard"
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_cli_export_takes_the_newest_valid_checkpoint_and_says_why(
    run_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    """One flipped byte inside tok_emb.weight of the newest step: that step is not exported;
    step 2 is, with a line naming the invalid one and the file."""
    root = run_copy / "checkpoints"
    shard = final_dir(root, 4) / "__0_0.distcp"
    flip_byte_of(shard, load_model_state(final_dir(root, 4))["tok_emb.weight"])
    out = tmp_path / "x.safetensors"
    assert main(["export", str(run_copy), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "step-00000004 is invalid and skipped" in captured.err
    assert "__0_0.distcp: xxh3 mismatch" in captured.err
    assert "exported step-00000002, the newest valid one" in captured.err
    assert "from step 2" in captured.out
    exported = load_file(out)
    want = load_model_state(final_dir(root, 2))
    assert all(torch.equal(exported[k], want[k]) for k in exported)

    # Asked for by step or by directory: refused, one line, exit 2.
    for args in (["--step", "4"], []):
        target = str(final_dir(root, 4)) if not args else str(run_copy)
        assert main(["export", target, *args, "-o", str(tmp_path / "y.safetensors")]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "xxh3 mismatch" in err


def test_an_existing_output_is_refused_unless_forced(
    run_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    """One rule for a file and a --format hf directory: refused (exit 2, one line, the file
    untouched) unless --force, which replaces it."""
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"someone's file")
    assert main(["export", str(run_copy), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "exists" in err and "--force" in err
    assert out.read_bytes() == b"someone's file"
    assert main(["export", str(run_copy), "-o", str(out), "--force"]) == 0
    assert set(load_file(out)) == set(load_model_state(final_dir(run_copy / "checkpoints", 4)))

    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(ConfigError, match="exists.*--force"):
        export_hf(final_dir(run_copy / "checkpoints", 4), folder)


def test_exported_file_has_a_new_files_mode(run_copy: Path, tmp_path: Path):
    out = tmp_path / "m.safetensors"
    export_weights(final_dir(run_copy / "checkpoints", 4), out, "safetensors")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask


def test_cli_checkpoints_exit_status_when_none_is_valid(
    run_copy: Path, capsys: pytest.CaptureFixture
):
    root = run_copy / "checkpoints"
    for step in (2, 4):
        shard = final_dir(root, step) / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    assert main(["checkpoints", str(run_copy), "--verify", "fast"]) == 0  # sizes hold
    assert main(["checkpoints", str(run_copy), "--verify", "full"]) == 4
    (final_dir(root, 4) / "manifest.json").write_text("{garbled")
    rows = collect(root, "fast")
    assert [(r["step"], r["status"], r["valid"]) for r in rows] == [
        (2, "complete", True), (4, "damaged", False),
    ]
    assert main(["checkpoints", str(run_copy)]) == 3
    capsys.readouterr()
