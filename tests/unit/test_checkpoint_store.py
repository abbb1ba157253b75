"""Unit tests of trainwise.run.checkpoint.store on real files: names, commit (manifest last,
no tmp left, durable), verification of corrupted, truncated and missing files, listing,
finding the newest valid checkpoint, cleanup of interrupted saves and retention."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

import pytest
import xxhash

from helpers import hang_limit, run_limited
from trainwise.run.checkpoint import store as cs
from trainwise.run.checkpoint.store import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    Manifest,
    apply_retention,
    clean_incomplete,
    commit,
    config_hash,
    digest_file,
    dir_bytes,
    final_dir,
    find_latest_valid,
    list_checkpoints,
    parse_step,
    read_manifest,
    scan_files,
    step_dir_name,
    tmp_dir,
    verify,
)


def _fields(step: int) -> dict:
    return {
        "step": step,
        "tokens": step * 1000,
        "world_size": 2,
        "dp_size": 2,
        "strategy": "ddp",
        "config_hash": config_hash("model = 'tiny'\n"),
        "trainwise_version": "0.1.0",
        "torch_version": "2.6.0",
        "step_time": 1_700_000_000.0 + step,
    }


def _save(root: Path, step: int, files: dict[str, bytes] | None = None) -> Path:
    """A checkpoint as the runtime would write it: files into tmp, then commit."""
    if files is None:
        files = {"model.pt": b"weights-%d" % step * 50, "shards/optim-0.pt": b"optim" * 30}
    tmp = tmp_dir(root, step)
    for rel, data in files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    commit(tmp, final_dir(root, step), _fields(step))
    return final_dir(root, step)


def _flip_byte(path: Path, offset: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# --- names -------------------------------------------------------------------------------


def test_names_and_parse_round_trip(tmp_path: Path):
    assert step_dir_name(120) == "step-00000120"
    assert tmp_dir(tmp_path, 120) == tmp_path / "step-00000120.tmp"
    assert final_dir(tmp_path, 120) == tmp_path / "step-00000120"
    for step in (0, 1, 120, 99_999_999, 123_456_789):
        assert parse_step(step_dir_name(step)) == step
    for name in ("step-00000120.tmp", "step-120", "step-0000012a", "x-00000120", "", MANIFEST):
        assert parse_step(name) is None, name
    with pytest.raises(CheckpointError):
        step_dir_name(-1)


def test_hash_helpers(tmp_path: Path):
    path = tmp_path / "f.bin"
    data = os.urandom(3 * 1024 + 7)
    path.write_bytes(data)
    assert digest_file(path, chunk=1024) == xxhash.xxh3_128(data).hexdigest()
    assert digest_file(path, "sha256", chunk=1024) == hashlib.sha256(data).hexdigest()
    assert config_hash("abc") == hashlib.sha256(b"abc").hexdigest()[:16]
    assert config_hash("abc") != config_hash("abd")


# --- commit ------------------------------------------------------------------------------


def test_commit_writes_manifest_matching_files(tmp_path: Path):
    files = {"model.pt": b"m" * 1000, "shards/optim-0.pt": b"o" * 77, "shards/sub/x": b""}
    final = _save(tmp_path, 120, files)

    manifest = read_manifest(final)
    assert manifest is not None
    assert manifest.format == FORMAT and manifest.step == 120 and manifest.tokens == 120_000
    assert [e.path for e in manifest.files] == sorted(files)
    for entry in manifest.files:
        data = files[entry.path]
        assert entry.bytes == len(data)
        assert entry.checksum == ("xxh3", xxhash.xxh3_128(data).hexdigest())
    assert manifest.total_bytes == sum(len(d) for d in files.values())
    assert manifest.created > 0
    # the manifest on disk is plain JSON that round-trips, and does not list itself
    raw = json.loads((final / MANIFEST).read_text())
    assert Manifest.model_validate(raw) == manifest
    assert MANIFEST not in {e.path for e in manifest.files}
    assert verify(final, "full") == []


def test_commit_leaves_no_tmp(tmp_path: Path):
    _save(tmp_path, 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005"]
    assert not (final_dir(tmp_path, 5) / "manifest.json.part").exists()


def test_commit_refuses_complete_final_and_replaces_manifestless_one(tmp_path: Path):
    _save(tmp_path, 3)
    tmp = tmp_dir(tmp_path, 3)
    tmp.mkdir()
    (tmp / "model.pt").write_bytes(b"new")
    with pytest.raises(CheckpointError, match="already exists and is complete"):
        commit(tmp, final_dir(tmp_path, 3), _fields(3))
    assert not (tmp / MANIFEST).exists()  # refused before writing anything

    # a final-named dir without manifest (interrupted by someone else) is replaced
    stale = final_dir(tmp_path, 4)
    stale.mkdir()
    (stale / "junk").write_bytes(b"junk")
    final = _save(tmp_path, 4, {"model.pt": b"good"})
    assert final == stale and not (final / "junk").exists()
    assert verify(final, "full") == []
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-00000003", "step-00000003.tmp", "step-00000004"]  # refused tmp kept


def test_commit_rejects_bad_fields(tmp_path: Path):
    tmp = tmp_dir(tmp_path, 1)
    tmp.mkdir()
    (tmp / "a").write_bytes(b"a")
    fields = _fields(1)
    del fields["strategy"]
    with pytest.raises(CheckpointError, match="strategy"):
        commit(tmp, final_dir(tmp_path, 1), fields)
    with pytest.raises(CheckpointError, match="step 1"):
        commit(tmp, final_dir(tmp_path, 2), _fields(1))  # name and manifest disagree
    with pytest.raises(CheckpointError, match="not a directory"):
        commit(tmp_path / "nope.tmp", final_dir(tmp_path, 9), _fields(9))
    assert not final_dir(tmp_path, 1).exists() and not final_dir(tmp_path, 2).exists()


def test_crash_before_final_rename_leaves_no_final_dir(tmp_path: Path, monkeypatch):
    tmp = tmp_dir(tmp_path, 7)
    tmp.mkdir()
    (tmp / "model.pt").write_bytes(b"x" * 10)
    real_rename = os.rename

    def crashing_rename(src, dst):
        if Path(dst) == final_dir(tmp_path, 7):
            raise OSError("simulated crash")
        real_rename(src, dst)

    monkeypatch.setattr(cs.os, "rename", crashing_rename)
    with pytest.raises(OSError, match="simulated crash"):
        commit(tmp, final_dir(tmp_path, 7), _fields(7))
    monkeypatch.undo()
    # old state: nothing committed; the .tmp leftover is found and cleaned
    assert list_checkpoints(tmp_path) == []
    assert clean_incomplete(tmp_path) == [tmp]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name fds")
def test_commit_fsyncs_data_manifest_and_directories(tmp_path: Path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(cs.os, "fsync", recording_fsync)
    _save(tmp_path, 2, {"model.pt": b"m", "sub/o.pt": b"o"})
    tmp, final = str(tmp_dir(tmp_path, 2)), str(final_dir(tmp_path, 2))
    assert f"{tmp}/model.pt" in synced and f"{tmp}/sub/o.pt" in synced  # data before manifest
    assert f"{tmp}/manifest.json.part" in synced
    assert synced.index(f"{tmp}/model.pt") < synced.index(f"{tmp}/manifest.json.part")
    assert synced.index(f"{tmp}/manifest.json.part") < synced.index(tmp, 2)  # tmp dir after
    assert synced[-1] == str(tmp_path)  # the parent, after the rename
    assert final not in synced  # fsync'd as the parent's entry, not needed itself


# --- verify ------------------------------------------------------------------------------


def test_verify_flipped_byte_full_only(tmp_path: Path):
    final = _save(tmp_path, 1)
    _flip_byte(final / "model.pt")
    assert verify(final, "fast") == []
    problems = verify(final, "full")
    assert problems == [f"{final / 'model.pt'}: xxh3 mismatch (corrupted)"]


@pytest.mark.parametrize("mode", ["full", "fast"])
def test_verify_truncation_names_file(tmp_path: Path, mode: str):
    final = _save(tmp_path, 1)
    target = final / "shards" / "optim-0.pt"
    size = target.stat().st_size
    target.write_bytes(target.read_bytes()[:10])
    problems = verify(final, mode)
    assert len(problems) == 1
    assert problems[0] == (f"{target}: 10 bytes, manifest says {size} (truncated or overwritten)")


@pytest.mark.parametrize("mode", ["full", "fast"])
def test_verify_missing_file(tmp_path: Path, mode: str):
    final = _save(tmp_path, 1)
    (final / "model.pt").unlink()
    assert verify(final, mode) == [f"{final / 'model.pt'}: missing"]


def test_verify_ignores_extra_files(tmp_path: Path):
    final = _save(tmp_path, 1)
    (final / "notes.txt").write_text("added later")
    assert verify(final, "full") == []


def test_verify_missing_and_garbled_manifest(tmp_path: Path):
    final = _save(tmp_path, 1)
    (final / MANIFEST).unlink()
    assert read_manifest(final) is None
    [problem] = verify(final, "full")
    assert MANIFEST in problem and "missing manifest" in problem

    (final / MANIFEST).write_text('{"step": 1, "tokens": ')  # torn JSON
    assert read_manifest(final) is None
    [problem] = verify(final, "fast")
    assert "manifest unreadable" in problem and "\n" not in problem

    good = json.loads((_save(tmp_path, 2) / MANIFEST).read_text())
    good["surprise"] = 1  # extra="forbid"
    (final / MANIFEST).write_text(json.dumps(good))
    [problem] = verify(final, "fast")
    assert "manifest unreadable" in problem and "surprise" in problem

    assert verify(tmp_path / "absent", "fast") == [
        f"{tmp_path / 'absent'}: missing (not a directory)"
    ]


def test_verify_rejects_paths_outside_dir(tmp_path: Path):
    final = _save(tmp_path, 1)
    raw = json.loads((final / MANIFEST).read_text())
    raw["files"].append({"path": "../escape", "bytes": 0, "sha256": ""})
    (final / MANIFEST).write_text(json.dumps(raw))
    [problem] = verify(final, "full")
    assert "bad file path '../escape'" in problem


# --- listing ------------------------------------------------------------------------------


def test_list_checkpoints_orders_and_ignores_tmp(tmp_path: Path):
    assert list_checkpoints(tmp_path / "missing") == []
    for step in (30, 2, 100):
        _save(tmp_path, step)
    tmp_dir(tmp_path, 200).mkdir()
    (tmp_path / "step-00000005").write_text("a file, not a dir")
    (tmp_path / "other").mkdir()

    infos = list_checkpoints(tmp_path)
    assert [i.step for i in infos] == [2, 30, 100]
    assert all(i.valid and i.manifest is not None for i in infos)
    assert infos[0].path == final_dir(tmp_path, 2)

    _flip_byte(final_dir(tmp_path, 30) / "model.pt")
    (final_dir(tmp_path, 100) / MANIFEST).write_text("not json")
    by_mode = {m: list_checkpoints(tmp_path, m) for m in ("none", "fast", "full")}
    assert [i.valid for i in by_mode["none"]] == [True, True, False]  # only manifest read
    assert [i.valid for i in by_mode["fast"]] == [True, True, False]
    assert [i.valid for i in by_mode["full"]] == [True, False, False]
    assert "xxh3 mismatch" in by_mode["full"][1].problems[0]
    assert "manifest unreadable" in by_mode["none"][2].problems[0]


def test_find_latest_valid_skips_corrupted_newest(tmp_path: Path, monkeypatch):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    _flip_byte(final_dir(tmp_path, 3) / "model.pt")

    hashed: list[Path] = []
    real_digest = cs.digest_file
    monkeypatch.setattr(
        cs, "digest_file", lambda p, *a: hashed.append(Path(p)) or real_digest(p, *a)
    )

    latest, skipped = find_latest_valid(tmp_path, "full")
    assert latest is not None and latest.step == 2 and latest.valid
    assert [s.step for s in skipped] == [3]
    assert skipped[0].problems == [
        f"{final_dir(tmp_path, 3) / 'model.pt'}: xxh3 mismatch (corrupted)"
    ]
    # stops at the first valid one: step 1 is never hashed
    assert hashed and not any(final_dir(tmp_path, 1) in p.parents for p in hashed)

    # fast mode does not see the flipped byte
    latest, skipped = find_latest_valid(tmp_path, "fast")
    assert latest is not None and latest.step == 3 and skipped == []


def test_find_latest_valid_none_valid(tmp_path: Path):
    assert find_latest_valid(tmp_path, "full") == (None, [])
    for step in (1, 2):
        _save(tmp_path, step)
    (final_dir(tmp_path, 1) / "model.pt").unlink()
    (final_dir(tmp_path, 2) / MANIFEST).unlink()
    latest, skipped = find_latest_valid(tmp_path, "fast")
    assert latest is None
    assert [s.step for s in skipped] == [2, 1]
    assert all(s.problems and not s.valid for s in skipped)


# --- cleanup and retention ---------------------------------------------------------------


def test_clean_incomplete(tmp_path: Path):
    assert clean_incomplete(tmp_path / "missing") == []
    complete = _save(tmp_path, 1)
    tmp = tmp_dir(tmp_path, 2)
    (tmp / "sub").mkdir(parents=True)
    (tmp / "sub" / "x").write_bytes(b"x")
    no_manifest = final_dir(tmp_path, 3)
    no_manifest.mkdir()
    (no_manifest / "model.pt").write_bytes(b"partial")
    (tmp_path / "README").write_text("keep me")
    (tmp_path / "other").mkdir()

    removed = clean_incomplete(tmp_path)
    assert sorted(removed) == sorted([tmp, no_manifest])
    assert not tmp.exists() and not no_manifest.exists()
    assert verify(complete, "full") == []
    assert (tmp_path / "README").exists() and (tmp_path / "other").is_dir()
    assert clean_incomplete(tmp_path) == []


def test_apply_retention_keep_last_and_every(tmp_path: Path):
    for step in range(1, 8):
        _save(tmp_path, step, {"model.pt": b"m"})
    tmp_dir(tmp_path, 8).mkdir()  # an in-flight save: not retention's business
    final_dir(tmp_path, 9).mkdir()  # manifest-less: left to clean_incomplete

    deleted = apply_retention(tmp_path, keep_last=2, keep_every=3)
    assert deleted == [final_dir(tmp_path, s) for s in (1, 2, 4, 5)]
    assert [i.step for i in list_checkpoints(tmp_path)] == [3, 6, 7, 9]
    assert tmp_dir(tmp_path, 8).is_dir()
    assert not any(p.name.endswith(".del.tmp") for p in tmp_path.iterdir())
    assert apply_retention(tmp_path, keep_last=2, keep_every=3) == []


def test_apply_retention_never_deletes_newest(tmp_path: Path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    final_dir(tmp_path, 4).mkdir()  # newer but incomplete: does not count as newest
    deleted = apply_retention(tmp_path, keep_last=0)
    assert deleted == [final_dir(tmp_path, 1), final_dir(tmp_path, 2)]
    assert final_dir(tmp_path, 3).is_dir() and final_dir(tmp_path, 4).is_dir()
    assert apply_retention(tmp_path / "missing", keep_last=1) == []
    with pytest.raises(CheckpointError):
        apply_retention(tmp_path, keep_last=-1)
    with pytest.raises(CheckpointError):
        apply_retention(tmp_path, keep_last=1, keep_every=0)


def test_scan_files_and_dir_bytes(tmp_path: Path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "y").write_bytes(b"yy")
    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / MANIFEST).write_text("{}")
    (tmp_path / "b" / MANIFEST).write_bytes(b"nested")  # only the top-level one is excluded
    (tmp_path / "link").symlink_to(tmp_path / "a")
    entries = scan_files(tmp_path, with_checksum=False)
    assert [(e.path, e.bytes, e.checksum) for e in entries] == [
        ("a", 1, ("", "")),
        ("b/manifest.json", 6, ("", "")),
        ("b/y", 2, ("", "")),
    ]
    assert dir_bytes(tmp_path) == 1 + 2 + 2 + 6
    assert dir_bytes(tmp_path / "missing") == 0


# --- no torch -----------------------------------------------------------------------------


def test_module_does_not_import_torch():
    source = Path(cs.__file__).read_text()
    assert not re.search(r"^\s*(import|from)\s+torch\b", source, re.MULTILINE)
    result = run_limited(
        [sys.executable, "-c",
         "import trainwise.run.checkpoint.store, sys; print('torch' in sys.modules)"],
        what="an import of trainwise.run.checkpoint.store", limit=hang_limit(procs=0),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_scan_files_reuses_hashes_the_writers_computed(tmp_path: Path):
    (tmp_path / "__0_0.distcp").write_bytes(b"rank zero")
    (tmp_path / "__1_0.distcp").write_bytes(b"rank one")
    known = {
        "__0_0.distcp": cs.FileEntry(path="__0_0.distcp", bytes=9, xxh3="from-rank-0"),
        "__1_0.distcp": cs.FileEntry(path="__1_0.distcp", bytes=3, xxh3="stale"),  # size off
    }
    entries = {e.path: e.xxh3 for e in cs.scan_files(tmp_path, known=known)}
    assert entries["__0_0.distcp"] == "from-rank-0"  # taken as given: not read again
    assert entries["__1_0.distcp"] == xxhash.xxh3_128(b"rank one").hexdigest()


def test_hash_files_in_threads_matches_one_by_one(tmp_path: Path):
    paths = []
    for i in range(5):
        path = tmp_path / f"f{i}"
        path.write_bytes(os.urandom(100_000 + i))
        paths.append(path)
    assert cs.hash_files(paths) == {p: cs.digest_file(p) for p in paths}
    assert cs.hash_files(paths, "sha256") == {p: cs.digest_file(p, "sha256") for p in paths}


def test_a_manifest_of_an_earlier_release_is_verified_by_its_sha256(tmp_path: Path):
    final = _save(tmp_path, 7)
    raw = json.loads((final / MANIFEST).read_text())
    for entry in raw["files"]:  # as earlier releases wrote it: sha256, no xxh3
        entry["sha256"] = hashlib.sha256((final / entry["path"]).read_bytes()).hexdigest()
        del entry["xxh3"]
    (final / MANIFEST).write_text(json.dumps(raw))
    assert verify(final, "full") == []
    _flip_byte(final / "model.pt")
    assert verify(final, "full") == [f"{final / 'model.pt'}: sha256 mismatch (corrupted)"]


# --- unreadable manifests are damage, not another lineage ------------------------------------


def _save_of(root: Path, step: int, lineage: str) -> Path:
    tmp = tmp_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / "model.pt").write_bytes(b"w%d" % step * 40)
    commit(tmp, final_dir(root, step), {**_fields(step), "lineage": lineage})
    return final_dir(root, step)


def test_a_garbled_manifest_is_skipped_as_invalid_not_passed_over(tmp_path: Path):
    root = tmp_path / "ckpt"
    _save_of(root, 4, "aaaa")
    _save_of(root, 8, "bbbb")  # another lineage's: passed over unverified, not "invalid"
    garbled = _save_of(root, 12, "aaaa")
    (garbled / MANIFEST).write_text('{"step": 12, "tok')
    best, skipped = find_latest_valid(root, "fast", lineage="aaaa")
    assert best is not None and best.step == 4
    assert [info.step for info in skipped] == [12]
    assert str(garbled / MANIFEST) in skipped[0].problems[0]
    assert "manifest unreadable" in skipped[0].problems[0]


def test_make_room_deletes_only_what_this_lineage_wrote(tmp_path: Path):
    root = tmp_path / "ckpt"
    own = _save_of(root, 4, "aaaa" * 4)
    _flip_byte(own / "model.pt")  # damaged, but this lineage's: a new save replaces it
    assert cs.make_room(own, "aaaa" * 4) is None and not own.exists()

    theirs = _save_of(root, 8, "bbbb" * 4)
    garbled = _save_of(root, 12, "aaaa" * 4)
    (garbled / MANIFEST).write_bytes(b"\x00garbage")
    kept = [cs.make_room(path, "aaaa" * 4) for path in (theirs, garbled)]
    assert not theirs.exists() and not garbled.exists()
    assert (kept[0] / theirs.name / "model.pt").read_bytes() == b"w8" * 40
    assert kept[0].name.endswith("-bbbbbbbb")  # labelled with the lineage that wrote it
    assert kept[0].parent == root / cs.PREVIOUS
    assert (kept[1] / garbled.name / "model.pt").is_file()
    assert kept[1].name.endswith("-unknown")


def test_move_aside_labels_with_the_old_lineage(tmp_path: Path):
    root = tmp_path / "ckpt"
    _save_of(root, 4, "1111" * 4)
    _save_of(root, 8, "2222" * 4)
    moved = cs.move_aside(root)
    assert moved is not None and moved.name.endswith("-22222222")
    assert sorted(p.name for p in moved.iterdir()) == ["step-00000004", "step-00000008"]
