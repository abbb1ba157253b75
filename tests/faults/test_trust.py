"""Nothing unverified is trusted: a garbled manifest is a damaged checkpoint (warned about,
skipped, kept), never "another lineage" nor a reason to delete; a checkpoint of another
model taken with resume_from_other is refused before any worker; an export onto a full
disk is one line. One in-process worker on copies of the session's reference run."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from faulty import (
    References,
    assert_identical,
    fault_limit,
    final_weights,
    finish,
    job_args,
    start,
    tmpfs,
)

from helpers import run_cli, run_main

# Each test's limit: its runs and the references it may wait for, and for the first, the module fixture's runs.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(fault_limit(launches=1))]

# The reference run (1 x single) has checkpoints at 4, 8 and 12.


def killed_after_last_save(run_dir: Path) -> None:
    """A finished run made to look killed after its last save (no finish event)."""
    log = run_dir / "events.jsonl"
    kept = [line for line in log.read_text().splitlines() if json.loads(line)["kind"] != "finish"]
    log.write_text("".join(line + "\n" for line in kept))


def copy_of_reference(workdir: Path, reference: References) -> Path:
    run_dir = workdir / "run"
    shutil.copytree(reference.run(1, "single"), run_dir)
    killed_after_last_save(run_dir)
    return run_dir


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def garble(manifest: Path) -> None:
    manifest.write_bytes(manifest.read_bytes()[:40] + b"\x00 not json")


def contents(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_garbled_newest_manifest_is_named_skipped_and_kept(
    workdir: Path, reference: References
):
    run_dir = copy_of_reference(workdir, reference)
    newest = step_dir(run_dir, 12)
    garble(newest / "manifest.json")
    before = contents(newest)
    rc, _, err = finish(start(job_args(run_dir, 1, "single"), workdir))
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if "is invalid and skipped" in line]
    assert len(warnings) == 1, err
    assert str(newest / "manifest.json") in warnings[0] and "manifest unreadable" in warnings[0]
    assert "resuming from step 8" in err
    # The new step 12 took the name; the damaged one was moved aside, byte for byte.
    kept = list((run_dir / "checkpoints" / "previous").glob("*-unknown/step-00000012"))
    assert len(kept) == 1 and contents(kept[0]) == before, err
    assert_identical(reference.weights(1, "single"), final_weights(run_dir))


def test_no_readable_manifest_stops_with_one_line_and_deletes_nothing(
    workdir: Path, reference: References
):
    run_dir = copy_of_reference(workdir, reference)
    for step in (4, 8, 12):
        garble(step_dir(run_dir, step) / "manifest.json")
    before = contents(run_dir / "checkpoints")
    rc, out, err = finish(start(job_args(run_dir, 1, "single"), workdir))
    assert rc == 1, err
    assert "starting fresh" not in err
    last = err.strip().splitlines()[-1]  # the run's one line; a warning per checkpoint above
    assert last.startswith("trainwise: no valid checkpoint"), err
    assert "3 found, all invalid" in last and "manifest unreadable" in last
    assert sum("is invalid and skipped" in line for line in err.splitlines()) == 3
    assert "Traceback" not in err and "Traceback" not in out
    assert contents(run_dir / "checkpoints") == before


def test_weights_of_another_model_are_refused_before_any_worker(
    workdir: Path, reference: References
):
    """resume_from_other = 'weights' with another model: one line, exit 2, and no worker
    started (no launch, so no restart: the run's events are untouched)."""
    run_dir = copy_of_reference(workdir, reference)
    events = (run_dir / "events.jsonl").read_text()
    args = job_args(
        run_dir, 2, "ddp", "--set", "model.name=small",
        "--set", "checkpoint.resume_from_other=weights", "--set", "checkpoint.max_restarts=3",
    )
    done = run_main(*args, cwd=workdir)  # a refusal: no process of its own needed
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "does not fit this job's model" in lines[0] and "tok_emb.weight is [" in lines[0]
    assert str(step_dir(run_dir, 12)) in lines[0]
    assert (run_dir / "events.jsonl").read_text() == events


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 64 KB: far smaller than the tiny model's 480 KB of weights."""
    with tmpfs(tmp_path / "full", 64 << 10) as mount:
        yield mount


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps of the Llama-style 'small' preset (what --format hf exports), saved."""
    root = tmp_path_factory.mktemp("llama")
    args = job_args(root / "run", 1, "single", "--set", "model.name=small", steps=2)
    done = run_cli(*args, "--set", "checkpoint.interval=2", cwd=root)
    assert done.returncode == 0, done.stderr
    return root / "run"


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_an_export_onto_a_full_disk_is_one_line(
    workdir: Path, llama_run: Path, full_disk: Path, fmt: str
):
    out = full_disk / ("model" if fmt == "hf" else "model.safetensors")
    done = run_cli("export", str(llama_run), "--format", fmt, "-o", str(out), cwd=workdir)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"-o {out}" in lines[0] and "no space left on the device" in lines[0]
    assert list(full_disk.iterdir()) == []  # no partial output that could look complete


def test_an_hf_export_has_one_mode_and_replaces_only_with_force(workdir: Path, llama_run: Path):
    """Through the CLI's main in this process (the export as a process: the full-disk tests)."""
    out = workdir / "hf"
    first = run_main("export", str(llama_run), "--format", "hf", "-o", str(out), cwd=workdir)
    assert first.returncode == 0, first.stderr
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes

    (out / "mine.txt").write_text("kept unless --force")
    again = run_main("export", str(llama_run), "--format", "hf", "-o", str(out), cwd=workdir)
    assert again.returncode == 2 and "--force" in again.stderr, again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and (out / "mine.txt").is_file()
    forced = run_main("export", str(llama_run), "--format", "hf", "-o", str(out), "--force",
                      cwd=workdir)
    assert forced.returncode == 0, forced.stderr
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in workdir.iterdir() if p.name.startswith("hf")] == ["hf"]
