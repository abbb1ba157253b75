"""Checkpoint directories on disk: names, the manifest written last, verification, listing,
cleanup of interrupted saves and retention.

A checkpoint root (e.g. runs/NAME/checkpoints/) holds committed checkpoints named
``step-00000120/``. A save writes into the sibling ``step-00000120.tmp/``; ``commit()`` then
writes ``manifest.json`` into it last and renames it to the final name. A directory is
complete only with its manifest, so a crash at any point leaves either the old state or a
complete new checkpoint.

Pure file operations: this module must not import torch, so that listing, verifying and
cleaning checkpoints works from any process (the CLI, the report) without a torch start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from trainwise.checksum import CHECKSUM, digest_file
from trainwise.errors import TrainwiseError

MANIFEST = "manifest.json"
FORMAT = 1

_PART = MANIFEST + ".part"
_TMP_SUFFIX = ".tmp"
_STEP_RE = re.compile(r"step-(\d{8,})")


class CheckpointError(TrainwiseError):
    """A checkpoint cannot be written, committed or cleaned as asked."""


# --- names ---------------------------------------------------------------------------------

DEFAULT_ROOT = "checkpoints"  # under the run directory


def root_for(run_dir: Path, configured: str | None) -> Path:
    """Where a run keeps its checkpoints: ``checkpoint.dir`` when set (relative paths
    resolve against the working directory), else ``RUN/checkpoints``."""
    return Path(configured) if configured else Path(run_dir) / DEFAULT_ROOT


def step_dir_name(step: int) -> str:
    """The committed directory name of a step: ``step-00000120``."""
    if step < 0:
        raise CheckpointError(f"checkpoint step {step} is negative; steps start at 0")
    return f"step-{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    """Where a save of ``step`` writes before it is committed."""
    return Path(root) / (step_dir_name(step) + _TMP_SUFFIX)


def final_dir(root: Path, step: int) -> Path:
    """The committed directory of ``step``."""
    return Path(root) / step_dir_name(step)


def parse_step(name: str) -> int | None:
    """The step of a committed directory name; None for anything else (``.tmp`` included)."""
    match = _STEP_RE.fullmatch(name)
    return int(match.group(1)) if match else None


# --- manifest ------------------------------------------------------------------------------


class FileEntry(BaseModel):
    """One file of a checkpoint, as it was when the checkpoint was committed."""

    model_config = ConfigDict(extra="forbid")

    path: str  # relative posix path inside the checkpoint directory
    bytes: int
    xxh3: str | None = None  # xxh3-128 hex digest (CHECKSUM)
    sha256: str | None = None  # what manifests of earlier releases hold: still verified

    @property
    def checksum(self) -> tuple[str, str]:
        """(algorithm, hex digest) of this file; ("", "") when it was not hashed."""
        if self.xxh3:
            return "xxh3", self.xxh3
        return ("sha256", self.sha256) if self.sha256 else ("", "")


class Manifest(BaseModel):
    """``manifest.json``: what a checkpoint holds and how it was made. Written last."""

    model_config = ConfigDict(extra="forbid")

    format: int = FORMAT
    step: int
    tokens: int
    world_size: int
    dp_size: int
    strategy: str  # the writer's layout as people read it (ParallelDims.name: pp 2 x fsdp 2)
    config_hash: str
    lineage: str | None = None  # config.lineage: None in checkpoints of earlier releases
    trainwise_version: str
    torch_version: str
    created: float  # unix time of commit
    step_time: float  # unix time when the saved step finished (failure-cost accounting)
    stall_s: float | None = None  # time the training loop was blocked by this save
    save_s: float | None = None  # total save duration
    async_save: bool = False
    files: list[FileEntry]

    @property
    def total_bytes(self) -> int:
        return sum(entry.bytes for entry in self.files)


def config_hash(text: str) -> str:
    """A short, stable id of a config text (the first 16 hex chars of its sha256)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _regular_files(directory: Path) -> list[Path]:
    """Every regular file below ``directory``; symlinks are neither followed nor listed."""
    found = []
    for dirpath, _dirnames, filenames in os.walk(directory, followlinks=False):
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                found.append(path)
    return found


def scan_files(
    directory: Path, with_checksum: bool = True, known: dict[str, FileEntry] | None = None
) -> list[FileEntry]:
    """Every regular file of a checkpoint directory, recursively, sorted by path. The top-level
    manifest (and a leftover ``manifest.json.part``) is not part of what it describes.
    ``known`` holds entries already hashed elsewhere (each rank hashes the files it wrote),
    keyed by relative path; one is used only if the file still has its size."""
    directory = Path(directory)
    known = known or {}
    paths = [
        path
        for path in _regular_files(directory)
        if path.relative_to(directory).as_posix() not in (MANIFEST, _PART)
    ]
    sizes = {path: path.stat().st_size for path in paths}

    def reusable(path: Path) -> FileEntry | None:
        entry = known.get(path.relative_to(directory).as_posix())
        return entry if entry is not None and entry.bytes == sizes[path] else None

    todo = [path for path in paths if reusable(path) is None]
    digests = hash_files(todo) if with_checksum else {}
    entries = [
        reusable(path)
        or FileEntry(
            path=path.relative_to(directory).as_posix(),
            bytes=sizes[path],
            xxh3=digests.get(path),
        )
        for path in paths
    ]
    entries.sort(key=lambda entry: entry.path)
    return entries


HASH_THREADS = min(8, os.cpu_count() or 1)


def hash_files(paths: list[Path], algo: str = CHECKSUM) -> dict[Path, str]:
    """Digests of several files at once: the hashers release the GIL on large buffers, so
    the files of a checkpoint (one or more per rank) hash in parallel threads."""
    if len(paths) <= 1 or HASH_THREADS == 1:
        return {path: digest_file(path, algo) for path in paths}
    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(paths))) as pool:
        digests = pool.map(lambda path: digest_file(path, algo), paths)
        return dict(zip(paths, digests, strict=True))


def _one_line(error: ValidationError) -> str:
    """A pydantic error as one line (its default text spans several)."""
    parts = [
        f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
        for err in error.errors()
    ]
    shown = "; ".join(parts[:3])
    return shown + (f" (+{len(parts) - 3} more)" if len(parts) > 3 else "")


def root_cause(err: BaseException) -> str:
    """The root cause of a DCP failure in one line. DCP wraps each rank's exception with
    its traceback in a multi-line CheckpointException (its `failures`, by rank); the first
    wrapped exception is the cause."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        err = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _load_manifest(directory: Path) -> tuple[Manifest | None, str | None]:
    """The manifest of a directory, or None and the one-line problem that prevented it."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None, f"{path}: missing manifest (the save did not complete)"
    try:
        return Manifest.model_validate_json(path.read_bytes()), None
    except ValidationError as e:
        return None, f"{path}: manifest unreadable: {_one_line(e)}"
    except OSError as e:
        return None, f"{path}: manifest unreadable: {e.strerror or e}"


def read_manifest(directory: Path) -> Manifest | None:
    """The manifest of a checkpoint directory; None when it is missing or unreadable
    (``verify`` says which and why)."""
    return _load_manifest(directory)[0]


# --- durability ----------------------------------------------------------------------------


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory; a directory's fsync makes its entries (renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    """fsync every file and folder below ``directory``: the data must be on disk before the
    manifest that vouches for it, or a power loss could leave a manifest over torn files."""
    for dirpath, _dirnames, filenames in os.walk(directory, followlinks=False):
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                _fsync_path(path)
        _fsync_path(Path(dirpath))


def _remove_dir(path: Path) -> None:
    """Remove a checkpoint directory so that a crash midway leaves no half-deleted directory
    under a committed name: rename it to a ``.tmp`` sibling first (``clean_incomplete``
    finishes the job after a crash), then delete it."""
    trash = path.with_name(path.name + ".del" + _TMP_SUFFIX)
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    _fsync_path(path.parent)
    shutil.rmtree(trash)


# --- commit --------------------------------------------------------------------------------


def commit(
    tmp: Path,
    final: Path,
    manifest_fields: dict[str, Any],
    known: dict[str, FileEntry] | None = None,
) -> Manifest:
    """Seal a finished save: write the manifest into ``tmp`` last, then rename ``tmp`` to
    ``final``. ``manifest_fields`` holds every Manifest field but ``files`` (scanned here,
    reusing the ``known`` hashes of files hashed by the ranks that wrote them); ``created``
    defaults to now. Returns the manifest written."""
    tmp, final = Path(tmp), Path(final)
    if not tmp.is_dir():
        raise CheckpointError(
            f"cannot commit {tmp}: it is not a directory; write the checkpoint files there first"
        )
    if "files" in manifest_fields:
        raise CheckpointError(
            f"cannot commit {tmp}: manifest 'files' are scanned by commit(); do not pass them"
        )
    # Refuse before writing anything, so a refused commit leaves tmp exactly as it was.
    if (final / MANIFEST).is_file():
        raise CheckpointError(
            f"cannot commit {tmp}: {final} already exists and is complete; "
            "delete it or save under a new step"
        )

    # Data first: every byte the manifest describes must be durable before the manifest is.
    _fsync_tree(tmp)
    fields = {"created": time.time(), **manifest_fields, "files": scan_files(tmp, known=known)}
    try:
        manifest = Manifest(**fields)
    except ValidationError as e:
        raise CheckpointError(
            f"cannot commit {tmp}: bad manifest fields: {_one_line(e)}; fix the caller"
        ) from None
    name_step = parse_step(final.name)
    if name_step is not None and name_step != manifest.step:
        raise CheckpointError(
            f"cannot commit {tmp} as {final}: the manifest says step {manifest.step}; "
            f"use final_dir(root, {manifest.step})"
        )

    # The manifest is written to a .part file and renamed, so a manifest.json is never torn.
    part = tmp / _PART
    with open(part, "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(part, tmp / MANIFEST)
    _fsync_path(tmp)

    # A manifest-less final dir is a leftover of some other interrupted write; move it away
    # (atomically) so the rename below can take its name.
    if final.exists():
        if (final / MANIFEST).is_file():
            raise CheckpointError(
                f"cannot commit {tmp}: {final} appeared meanwhile and is complete; "
                "is another process saving the same step?"
            )
        _remove_dir(final)
    os.rename(tmp, final)
    _fsync_path(final.parent)
    if tmp.parent != final.parent:
        _fsync_path(tmp.parent)
    return manifest


# --- verification and listing -------------------------------------------------------------


def _unsafe_path(rel: str) -> bool:
    """A manifest path that would point outside the checkpoint directory."""
    parts = Path(rel).parts
    return not rel or Path(rel).is_absolute() or ".." in parts


def _check_files(directory: Path, manifest: Manifest, mode: Literal["full", "fast"]) -> list[str]:
    problems = []
    name_step = parse_step(directory.name)
    if name_step is not None and name_step != manifest.step:
        problems.append(
            f"{directory / MANIFEST}: manifest says step {manifest.step}, "
            f"the directory name says {name_step} (renamed by hand?)"
        )
    for entry in manifest.files:
        if _unsafe_path(entry.path):
            problems.append(f"{directory / MANIFEST}: bad file path {entry.path!r} in manifest")
            continue
        path = directory / entry.path
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != entry.bytes:
            problems.append(
                f"{path}: {size} bytes, manifest says {entry.bytes} (truncated or overwritten)"
            )
    if mode == "full" and not problems:  # hashing a file of the wrong size adds nothing
        problems += checksum_problems(expected_checksums(directory, manifest))
    return problems


def expected_checksums(
    directory: Path, manifest: Manifest, share: tuple[int, int] = (0, 1)
) -> dict[Path, tuple[str, str]]:
    """The files of a checkpoint with their (algorithm, digest); `share` = (i, n) keeps
    every n-th file from the i-th, so that n ranks hash a checkpoint together."""
    i, n = share
    return {
        directory / entry.path: entry.checksum
        for entry in manifest.files[i::n]
        if entry.checksum[0] and not _unsafe_path(entry.path)
    }


def checksum_problems(expected: dict[Path, tuple[str, str]]) -> list[str]:
    """One line per file whose digest is not the expected (algorithm, digest)."""
    problems = []
    for algo in sorted({a for a, _ in expected.values()}):
        paths = [path for path, (a, _) in expected.items() if a == algo]
        digests = hash_files(paths, algo)
        problems += [
            f"{path}: {algo} mismatch (corrupted)"
            for path in paths
            if digests[path] != expected[path][1]
        ]
    return problems


def verify(directory: Path, mode: Literal["full", "fast"]) -> list[str]:
    """The problems of a checkpoint directory, one line each naming the file; empty means
    valid. ``fast`` compares sizes only; ``full`` also hashes every file. Files present but
    not in the manifest are ignored."""
    if mode not in ("full", "fast"):
        raise CheckpointError(f"verify mode {mode!r} is unknown; use 'full' or 'fast'")
    directory = Path(directory)
    if not directory.is_dir():
        return [f"{directory}: missing (not a directory)"]
    manifest, problem = _load_manifest(directory)
    if manifest is None:
        return [problem or f"{directory / MANIFEST}: manifest unreadable"]
    return _check_files(directory, manifest, mode)


@dataclass
class CheckpointInfo:
    """A committed-named checkpoint directory and what is known about it."""

    path: Path
    step: int
    manifest: Manifest | None
    problems: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return self.manifest is not None and not self.problems


# Hashes a checkpoint's files against its manifest, one line per mismatch: by default in
# this process; a Checkpointer spreads it over the ranks.
Checksums = Callable[[Path, Manifest], list[str]]


def _info(
    path: Path,
    step: int,
    verify_mode: Literal["full", "fast", "none"],
    checksums: Checksums | None = None,
) -> CheckpointInfo:
    manifest, problem = _load_manifest(path)
    if manifest is None:
        return CheckpointInfo(path, step, None, [problem] if problem else [])
    if verify_mode == "none":
        return CheckpointInfo(path, step, manifest, [])
    if verify_mode == "full" and checksums is not None:
        problems = _check_files(path, manifest, "fast") or checksums(path, manifest)
    else:
        problems = _check_files(path, manifest, verify_mode)
    return CheckpointInfo(path, step, manifest, problems)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Committed-named directories under root, by step ascending (.tmp ones excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = parse_step(child.name)
        if step is not None and child.is_dir():
            found.append((step, child))
    found.sort(key=lambda item: item[0])
    return found


def list_checkpoints(
    root: Path, verify_mode: Literal["full", "fast", "none"] = "none"
) -> list[CheckpointInfo]:
    """Committed-named checkpoints under root, by step ascending. ``none`` only checks that the
    manifest is readable; a missing root gives []."""
    if verify_mode not in ("full", "fast", "none"):
        raise CheckpointError(f"verify mode {verify_mode!r} is unknown; use full, fast or none")
    return [_info(path, step, verify_mode) for step, path in _step_dirs(root)]


def find_latest_valid(
    root: Path,
    verify_mode: Literal["full", "fast"],
    lineage: str | None = None,
    checksums: Checksums | None = None,
) -> tuple[CheckpointInfo | None, list[CheckpointInfo]]:
    """The newest valid checkpoint (of `lineage` when given: others are passed over
    unverified; one whose manifest cannot be read may be of any lineage, so it is
    damaged, not passed over), and the newer ones skipped as invalid (with their
    problems). Verifies
    newest-first and stops at the first valid one, so older checkpoints are never hashed.
    `checksums` replaces the hashing of "full" (after the sizes are checked)."""
    if verify_mode not in ("full", "fast"):
        raise CheckpointError(f"verify mode {verify_mode!r} is unknown; use 'full' or 'fast'")
    skipped = []
    for step, path in reversed(_step_dirs(root)):
        if lineage is not None and _of_other_lineage(path, lineage):
            continue
        info = _info(path, step, verify_mode, checksums)
        if info.valid:
            return info, skipped
        skipped.append(info)
    return None, skipped


# --- cleanup and retention -----------------------------------------------------------------


def clean_incomplete(root: Path) -> list[Path]:
    """Remove interrupted saves: ``*.tmp`` directories and step directories without a
    manifest. Call it when no save is in progress (at start-up or resume), since an
    in-flight save lives in a ``.tmp`` directory. Returns the removed paths."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for child in sorted(root.iterdir()):
        if not child.is_dir() or child.is_symlink():
            continue
        if child.name.endswith(_TMP_SUFFIX):
            shutil.rmtree(child)
            removed.append(child)
        elif parse_step(child.name) is not None and not (child / MANIFEST).is_file():
            _remove_dir(child)
            removed.append(child)
    if removed:
        _fsync_path(root)
    return removed


def apply_retention(
    root: Path,
    keep_last: int,
    keep_every: int | None = None,
    *,
    lineage: str | None = None,
    protect: int | None = None,
) -> list[Path]:
    """Delete committed checkpoints except the newest ``keep_last`` complete ones and those whose
    step is a multiple of ``keep_every``. With ``lineage``, only that lineage's checkpoints
    are counted or deleted (another run's are never touched). The newest complete checkpoint
    and the step ``protect`` (the one just written) are always kept; ``.tmp`` and
    manifest-less directories are left to ``clean_incomplete``. Contents are not verified
    here (that would hash everything). Returns the deleted paths."""
    if keep_last < 0:
        raise CheckpointError(f"keep_last={keep_last} is negative; use 0 or more")
    if keep_every is not None and keep_every < 1:
        raise CheckpointError(f"keep_every={keep_every} must be at least 1, or None to disable")
    complete = [
        (step, path)
        for step, path in _step_dirs(root)
        if (path / MANIFEST).is_file() and (lineage is None or _of_lineage(path, lineage))
    ]
    if not complete:
        return []
    keep = {step for step, _ in complete[-max(keep_last, 1) :]} | {protect}
    deleted = []
    for step, path in complete:
        if step in keep or (keep_every is not None and step % keep_every == 0):
            continue
        _remove_dir(path)
        deleted.append(path)
    return deleted


def _of_other_lineage(path: Path, lineage: str) -> bool:
    """Whether a checkpoint's readable manifest names another lineage than `lineage`."""
    manifest, _ = _load_manifest(path)
    return manifest is not None and manifest.lineage not in (None, lineage)


def _of_lineage(path: Path, lineage: str) -> bool:
    """Whether a committed checkpoint belongs to `lineage`; one of an earlier release
    (no lineage recorded) is taken to, as it always was."""
    manifest, _ = _load_manifest(path)
    return manifest is not None and manifest.lineage in (None, lineage)


PREVIOUS = "previous"  # checkpoints of earlier lineages, moved aside (never deleted)


def previous_label(paths: list[Path]) -> str:
    """The name of a ``previous/`` folder for `paths`: the time of the move and the lineage
    that wrote them (the newest readable manifest's), "unknown" when none says."""
    lineages = [m.lineage for m in map(read_manifest, reversed(paths)) if m and m.lineage]
    return time.strftime("%Y%m%d-%H%M%S") + "-" + (lineages[0][:8] if lineages else "unknown")


def move_aside(root: Path, paths: list[Path] | None = None) -> Path | None:
    """Move `paths` (default: every checkpoint under `root`, committed or interrupted) into
    ``root/previous/<label>/`` (see previous_label), so that a new lineage starts from an
    empty root, or a damaged checkpoint of unknown lineage is kept rather than deleted;
    returns that folder, or None when there was nothing to move."""
    root = Path(root)
    found = paths if paths is not None else [
        child
        for child in (sorted(root.iterdir()) if root.is_dir() else [])
        if child.is_dir()
        and (parse_step(child.name) is not None or child.name.endswith(_TMP_SUFFIX))
    ]
    if not found:
        return None
    target = root / PREVIOUS / previous_label(found)
    target.mkdir(parents=True, exist_ok=True)
    for child in found:
        os.replace(child, target / child.name)
    _fsync_path(root)
    return target


def make_room(final: Path, lineage: str) -> Path | None:
    """Free the name of a checkpoint about to be committed. A directory there that this
    lineage wrote (a damaged one resume skipped, or an abandoned line of this run) is
    deleted; any other (another lineage's, or one whose manifest cannot be read) is moved
    into ``previous/``, never deleted: returns where it went, or None."""
    final = Path(final)
    if not final.exists():
        return None
    manifest = read_manifest(final)
    if manifest is not None and manifest.lineage in (None, lineage):
        _remove_dir(final)
        return None
    return move_aside(final.parent, [final])


def dir_bytes(directory: Path) -> int:
    """Total size of the regular files below a directory (0 when it does not exist)."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    return sum(path.stat().st_size for path in _regular_files(directory))
