"""Saving and loading a run's full training state with torch.distributed.checkpoint (DCP).

A checkpoint holds the model and optimizer (sharded as they live: DCP writes each rank's
shards and reshards on load), the trainer's progress (step, tokens, LR schedule, loss
scaler, data position) in trainer.json, and every rank's RNG states under rng/. It is
written into `step-XXXXXXXX.tmp/` and committed by rank 0 (manifest last, then rename):
see checkpoint_store. Checkpoint I/O runs on its own gloo process group, so a background
save never interleaves with the training collectives of the default group.
"""

from __future__ import annotations

import errno
import json
import logging
import pickle
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

from trainwise import __version__
from trainwise.config.lineage import lineage_hash
from trainwise.config.schema import CheckpointConfig
from trainwise.plan.model.reliability import interval_steps
from trainwise.run.checkpoint import store as store
from trainwise.run.checkpoint.resume_rules import TRAINER_FILE, differences, refusal
from trainwise.run.checkpoint.states import MODEL, OPTIMIZER, RNG, written_nested
from trainwise.run.checkpoint.store import CheckpointError, root_cause
from trainwise.run.job.distributed import side_group
from trainwise.run.observe.events import append_event
from trainwise.run.observe.peers import PeerError, find_peer_error, nested_errors

AUTO_FIRST_SAVE = 10  # interval = "auto": the first save (to measure the stall) at this step
# Files each rank writes in parallel threads (DCP's FileSystemWriter), later hashed in
# parallel too: one file per rank leaves a core idle on write and on hashing. (A failed
# extra thread is caught by missing_items and the excepthook below.)
WRITE_THREADS = 2


WRITER_THREAD = "_write_files_from_queue"  # DCP's extra writer threads are named after it


class _WriterThreadErrors:
    """Collects the exceptions DCP's extra writer threads end with (nothing re-raises
    them), instead of printing them as tracebacks. One hook per process, and it holds no
    Checkpointer: every thread started after the hook is installed keeps it alive in its
    own closure until that thread ends. A Checkpointer held there would be freed on such a
    thread (a DataLoader queue's feeder, say) during interpreter shutdown, and freeing its
    tensors there aborts the process ("terminate called without an active exception")."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []
        self._previous: Any = None

    def install(self) -> None:
        if self._previous is None:
            self._previous = threading.excepthook
            threading.excepthook = self._hook

    def _hook(self, args: Any) -> None:
        if args.thread is not None and WRITER_THREAD in args.thread.name and args.exc_value:
            self.errors.append(args.exc_value)
            return
        self._previous(args)

    def take(self) -> list[BaseException]:
        errors, self.errors = self.errors, []
        return errors


WRITER_ERRORS = _WriterThreadErrors()


def missing_items(metadata: Metadata) -> int:
    """Items DCP planned to save but has no storage record for. DCP's extra writer threads
    (thread_count > 1) end with an exception that nothing re-raises: their items are then
    silently missing from the checkpoint. Counting them catches that."""
    stored = metadata.storage_data or {}
    missing = 0
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            missing += sum(MetadataIndex(fqn, c.offsets) not in stored for c in md.chunks)
        elif MetadataIndex(fqn) not in stored:
            missing += 1
    return missing


def written_metadata(metadata: Metadata, tmp: Path) -> Metadata | None:
    """DCP's record of a save, with the storage records missing_items counts. torch 2.13
    returns them; 2.11 (seen on a GPU machine) returns the plan without them
    (storage_data None), and only the .metadata file it wrote in `tmp` has them. None
    when this rank cannot read that file (rank 0, which wrote it, checks it)."""
    if metadata.storage_data is not None:
        return metadata
    try:
        return FileSystemReader(str(tmp)).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


@dataclass
class Resumed:
    """Where a run continues from."""

    step: int = 0
    tokens: int = 0
    path: Path | None = None
    skipped: list[str] = field(default_factory=list)  # "<dir>: <problem>" per invalid one
    rng: str = "restored"  # restored | kept (written by another world size)
    trainer: dict[str, Any] = field(default_factory=dict)
    taken: str = "all"  # all | weights: what was taken from another lineage's checkpoint
    other: bool = False  # the checkpoint is of another lineage (checkpoint.resume_from_other)

    def line(self) -> str:
        """The first line of a resumed (or fresh) run."""
        skipped = (
            f"; skipped {len(self.skipped)} invalid: " + "; ".join(self.skipped)
            if self.skipped
            else ""
        )
        if self.path is None:
            return "starting fresh (no checkpoint to resume from)" + skipped
        other = (
            f"; another lineage's {'weights' if self.taken == 'weights' else 'state'}, "
            "checkpoint.resume_from_other"
            if self.other
            else ""
        )
        return (
            f"resuming from step {self.step} ({self.path}, written by "
            f"{self.trainer.get('strategy')} on {self.trainer.get('world_size')} workers; RNG "
            f"{self.rng}{other}){skipped}"
        )


@dataclass
class _InFlight:
    step: int
    future: Future
    thread: threading.Thread | None = None
    upload_error: BaseException | None = None  # DCP's write failed (on every rank)
    error: BaseException | None = None  # hashing, gathering or the commit failed
    peer: PeerError | None = None  # ... because a peer was lost
    message: str = ""  # the error's line, judged when it happened


@dataclass(frozen=True)
class Place:
    """Where a run's checkpoints go, and which of its ranks this is."""

    root: Path
    run_dir: Path
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class SaveSchedule:
    """What the save interval depends on besides checkpoint.*: the run's length and the
    cluster's failure rate (interval = "auto", Young/Daly)."""

    total_steps: int
    mtbf_hours: float = 6000.0
    nodes: int = 1


class Checkpointer:
    """Saves on the configured interval and resumes a run; one per worker, same calls on
    every rank. `states` are what DCP writes (states.training_states: model, optimizer,
    RNG); `progress` the small JSON ones that go into trainer.json (the LR schedule, the
    loss scaler or None); `meta` the facts the manifest and resume check (strategy,
    dp_size, config_hash, lineage keys)."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        place: Place,
        states: dict[str, Stateful],
        progress: dict[str, Any],
        meta: dict[str, Any],
        schedule: SaveSchedule,
        log: logging.Logger,
        *,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 600.0,
        attempt: int = 0,
    ):
        self.cfg = cfg
        self.place = place
        self.root, self.run_dir, self.device = place.root, place.run_dir, place.device
        self.rank, self.world, self.is_main = place.rank, place.world, place.is_main
        self.states = states
        self.progress = progress
        self.schedule = schedule
        self.meta = meta
        self.lineage = lineage_hash(meta["lineage"])
        self.attempt = attempt  # the launcher's restart count: 0 on a new launch
        self.other = False  # the checkpoint found is of another lineage
        self.lineage_started = False  # resume = 'never' moved earlier checkpoints aside
        self.log = log
        # Saves and loads run on `group`, the job's host group (run.job.distributed.
        # host_group; None: one process), in order with the main thread's collectives. An
        # async save's collectives run in a thread, and gloo matches operations by order:
        # with async saves the checkpointer takes a gloo group of its own.
        self.own_group = side_group(timeout_s) if cfg.async_save and group is not None else None
        self.group = self.own_group or group
        self.inflight: _InFlight | None = None
        # One stager for the whole run: it keeps its host buffers between saves (a fresh
        # one per save would allocate, and page-fault through, the whole state each time).
        cuda = self.device.type == "cuda"
        self.stager = DefaultStager(StagingOptions(cuda, False, False, cuda))
        # A failing DCP writer thread is caught rather than printed as a traceback; the
        # save then fails on every rank with one line (see _write_failure).
        WRITER_ERRORS.install()
        self.last_save_step = 0
        self.last_save_time = time.monotonic()
        self.stalls: list[float] = []
        self.auto_every: int | None = None
        self.before_commit: Any = None  # the fault seam's pause_in_save: f(step)
        self._last_tick: float | None = None
        self._step_s: list[float] = []

    def _write_failure(self, metadata: Any, tmp: Path) -> str | None:
        """Why DCP's write into `tmp` is incomplete on this rank, or None: a writer thread's
        error, or items without data."""
        errors = WRITER_ERRORS.take()
        if errors:
            return f"rank {self.rank}: a writer thread failed: {errors[0]}"
        if not isinstance(metadata, Metadata):
            return None
        written = written_metadata(metadata, tmp)
        if written is None and self.is_main:  # rank 0 wrote the file: it must read
            return f"rank 0: DCP's .metadata in {tmp} cannot be read back"
        if written is not None and (n := missing_items(written)):
            return f"rank {self.rank}: DCP recorded no data for {n} items"
        return None

    # -- schedule ---------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether `step` is a save step by the step-based rules (the same on every rank).
        Time-based rules are decided by rank 0 and agreed through the run's control flags."""
        if not self.cfg.enabled or step == self.last_save_step:
            return False
        if step == self.schedule.total_steps and self.cfg.save_final:
            return True
        if self.cfg.interval == "auto":  # later auto saves come from rank 0's wanted()
            # The first save (fresh or resumed) measures the stall.
            return not self.stalls and step - self.last_save_step == AUTO_FIRST_SAVE
        return step % self.cfg.interval == 0

    def wanted(self, step: int) -> bool:
        """Rank 0's clock-based wish to save after `step` (every_minutes, or the auto
        interval once a stall is measured). Clocks differ between ranks, so the wish is
        agreed through the control flags, never acted on directly."""
        now = time.monotonic()
        if self._last_tick is not None and step != self.last_save_step + 1:
            self._step_s = (self._step_s + [now - self._last_tick])[-50:]
        self._last_tick = now
        if not self.cfg.enabled:
            return False
        minutes = self.cfg.every_minutes
        if minutes and now - self.last_save_time >= minutes * 60:
            return True
        if self.cfg.interval == "auto" and self.stalls and self._step_s:
            self._update_auto_interval(float(np.median(self._step_s)))
            return self.auto_every is not None and step - self.last_save_step >= self.auto_every
        return False

    def _update_auto_interval(self, step_s: float) -> None:
        """Young/Daly: the interval that minimises expected loss, from the measured stall
        (median of the saves so far) and the cluster's failure rate."""
        stall = max(float(np.median(self.stalls)), 1e-6)
        sched = self.schedule
        every = interval_steps(stall, step_s, sched.mtbf_hours, sched.nodes, sched.total_steps)
        if every != self.auto_every:
            self.log.info(
                "trainwise: checkpoint interval auto = %d steps (save stall %.3f s, step %.3f s,"
                " MTBF %.0f h per node x %d nodes)",
                every, stall, step_s, sched.mtbf_hours, sched.nodes,
            )
        self.auto_every = every

    # -- save -------------------------------------------------------------------------

    def _trainer_state(self, step: int, tokens: int, data_state: dict[str, Any]) -> dict:
        progress = {k: v.state_dict() if v is not None else None for k, v in self.progress.items()}
        return {
            "step": step,
            "tokens": tokens,
            "world_size": self.world,
            **progress,
            "data": data_state,
            **self.meta,
        }

    def save(
        self, step: int, tokens: int, step_time: float, data_state: dict, *, sync: bool = False
    ) -> float:
        """Write a checkpoint of the state after `step`; returns the loop's stall in seconds.
        Async (unless `sync`): returns once the state is staged in host memory; the write
        and the commit finish in the background. At most one save is in flight."""
        t0 = time.perf_counter()
        self.wait()  # at most one in flight: the previous one must be committed first
        tmp = store.tmp_dir(self.root, step)
        use_async = self.cfg.async_save and not sync
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            state = dict(self.states)
            writer = FileSystemWriter(str(tmp), thread_count=WRITE_THREADS)
            if use_async:
                future = dcp.async_save(
                    state, storage_writer=writer, process_group=self.group,
                    async_stager=self.stager,
                )
            else:
                metadata = dcp.save(state, storage_writer=writer, process_group=self.group)
        except BaseException as err:  # DCP raises on every rank together; report one line
            if isinstance(err, KeyboardInterrupt):
                raise
            raise self._failed(step, tmp, err) from None
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self.last_save_step = step
        self.last_save_time = time.monotonic()
        info = {
            "step": step,
            "tokens": tokens,
            "step_time": step_time,
            "stall_s": stall,
            "trainer": self._trainer_state(step, tokens, data_state),
        }
        if self.before_commit is not None:
            self.before_commit(step)
        if not use_async:
            known, error = self._gather_hashes(tmp, self._write_failure(metadata, tmp))
            if self.is_main and error is None:
                try:
                    self._commit(info, t0, async_save=False, known=known)
                except Exception as err:  # noqa: BLE001
                    error = str(_save_error(step, tmp, err))
            self._agree(error, step)
            # A sync save stalls the loop for all of it, commit included.
            self.stalls[-1] = time.perf_counter() - t0
            return self.stalls[-1]
        flight = _InFlight(step, future)
        flight.thread = threading.Thread(
            target=self._finish_async, args=(flight, info, t0), daemon=True
        )
        flight.thread.start()
        self.inflight = flight
        return stall

    def _gather_hashes(
        self, tmp: Path, failure: str | None
    ) -> tuple[dict[str, store.FileEntry], str | None]:
        """Each rank hashes the files it wrote (DCP names them ``__<rank>_<n>.distcp``), so
        that rank 0 does not read every rank's bytes; rank 0 gets them all, or the first
        rank's `failure` (an incomplete write) to report. Files nobody claimed (another
        naming, .metadata) rank 0 hashes itself at the commit."""
        mine: list | str
        try:
            paths = sorted(tmp.glob(f"__{self.rank}_*.distcp"))
            digests = store.hash_files(paths) if failure is None else {}
            mine = failure or [(p.name, p.stat().st_size, digests[p]) for p in paths]
        except OSError as err:
            mine = f"rank {self.rank} could not hash its files: {err}"
        parts: list[Any] = [mine]
        if self.group is not None:
            parts = [None] * self.world if self.is_main else []
            dist.gather_object(mine, parts if self.is_main else None, dst=0, group=self.group)
        known: dict[str, store.FileEntry] = {}
        for part in parts if self.is_main else []:
            if isinstance(part, str):
                return {}, part
            for name, size, digest in part:
                known[name] = store.FileEntry(path=name, bytes=size, xxh3=digest)
        return known, None

    def _agree(self, error: str | None, step: int, peer: str | None = None) -> None:
        """Rank 0 alone commits; every rank learns whether it worked, so all stop together:
        with a CheckpointError, or with a PeerError (`peer` = its cause) when a rank was
        lost during the save, which a restart fixes."""
        if self.group is not None:
            box = [(error, peer)]
            dist.broadcast_object_list(box, src=0, group=self.group)
            error, peer = box[0]
        if error and peer:
            raise PeerError(peer, error)
        if error:
            if self.is_main:
                append_event(self.run_dir, "checkpoint_failed", step=step, message=error)
            raise CheckpointError(error)

    def _failed(self, step: int, tmp: Path, err: BaseException) -> BaseException:
        """The error a failed write raises. A collective that timed out or lost its peer
        is a peer failure (a restart fixes it), not a checkpoint problem."""
        peer = find_peer_error(err)
        if peer is not None:
            return PeerError(peer.cause, f"in the checkpoint save of step {step}: {peer}")
        error = _save_error(step, tmp, err)
        if self.is_main:
            append_event(self.run_dir, "checkpoint_failed", step=step, message=str(error))
        return error

    def _finish_async(self, flight: _InFlight, info: dict, t0: float) -> None:
        """On every rank, in the background: wait for DCP's write, hash this rank's files,
        and (rank 0) commit. Errors are reported by wait() on the loop's thread."""
        try:
            metadata = flight.future.result()
        except BaseException as err:  # noqa: BLE001 - DCP fails every rank together
            flight.upload_error = err
            return
        tmp = store.tmp_dir(self.root, flight.step)
        try:
            known, error = self._gather_hashes(tmp, self._write_failure(metadata, tmp))
            if error:
                raise CheckpointError(error)
            if self.is_main:
                self._commit(info, t0, async_save=True, known=known)
        except BaseException as err:  # noqa: BLE001
            flight.error = err
            # Judged now, not at the next wait(): free space may have changed by then.
            flight.peer = find_peer_error(err)
            flight.message = str(_save_error(flight.step, tmp, err))

    def _commit(
        self, info: dict, t0: float, async_save: bool, known: dict[str, store.FileEntry]
    ) -> None:
        step = info["step"]
        tmp = store.tmp_dir(self.root, step)
        (tmp / TRAINER_FILE).write_text(json.dumps(info["trainer"], indent=1) + "\n")
        final = store.final_dir(self.root, step)
        kept = store.make_room(final, self.lineage)
        if kept is not None:
            self.log.warning(
                "trainwise: %s was not written by this lineage (or its manifest cannot be "
                "read): moved to %s, not deleted", final, kept,
            )
        fields = {
            **{k: v for k, v in info.items() if k != "trainer"},
            "world_size": self.world,
            "dp_size": self.meta["dp_size"],
            "strategy": self.meta["strategy"],
            "config_hash": self.meta["config_hash"],
            "lineage": self.lineage,
            "trainwise_version": __version__,
            "torch_version": torch.__version__,
            "created": time.time(),
            "async_save": async_save,
        }
        fields["save_s"] = time.perf_counter() - t0
        if not async_save:  # the loop waited for the whole save
            fields["stall_s"] = fields["save_s"]
        manifest = store.commit(tmp, final, fields, known=known)
        deleted = store.apply_retention(
            self.root, self.cfg.keep_last, self.cfg.keep_every, lineage=self.lineage,
            protect=step,
        )
        append_event(
            self.run_dir, "checkpoint", step=step, step_time=info["step_time"],
            stall_s=manifest.stall_s, save_s=manifest.save_s, bytes=manifest.total_bytes,
            path=str(final), async_save=async_save, deleted=[p.name for p in deleted],
        )

    def wait(self) -> None:
        """Finish the save in flight (if any). Called at the same points on every rank; a
        failed background save raises here on every rank and never leaves a checkpoint
        that looks valid."""
        flight, self.inflight = self.inflight, None
        if flight is None:
            return
        tmp = store.tmp_dir(self.root, flight.step)
        if flight.thread is not None:
            flight.thread.join()
        if flight.upload_error is not None:
            raise self._failed(flight.step, tmp, flight.upload_error) from None
        if flight.peer is not None and not self.is_main:
            raise flight.peer  # the group is broken: rank 0's broadcast will not come
        error = peer = None
        if flight.peer is not None:  # set only together with flight.error
            error = f"in the checkpoint save of step {flight.step}: {flight.peer}"
            peer = flight.peer.cause
        elif flight.error is not None:
            error = flight.message
        self._agree(error if self.is_main else None, flight.step, peer if self.is_main else None)

    # -- load -------------------------------------------------------------------------

    def find(self) -> tuple[Path | None, list[str]]:
        """Rank 0 picks the checkpoint to resume from (cleaning interrupted saves first);
        every rank gets the same answer. With verify = "full", every rank hashes its share
        of each candidate's files as rank 0 asks (see `_spread_checksums`)."""
        self.wait()  # a rollback may come while a save is in flight
        if self.is_main:
            try:
                box = [*self._find_on_main(), None, self.other]
            except CheckpointError as err:
                box = [None, [], (str(err), err.exit_status), False]
            if self.group is not None:
                dist.broadcast_object_list([("answer", box)], src=0, group=self.group)
        else:
            box = self._serve_checksums()
        path, skipped, error, self.other = box
        if error:
            failure = CheckpointError(error[0])
            failure.exit_status = error[1]  # 2 for another lineage: bad input, not a fault
            raise failure
        return (Path(path) if path else None), skipped

    def _spread_checksums(self, path: Path, manifest: store.Manifest) -> list[str]:
        """On rank 0: every rank hashes every world-th file of `path` (rank 0 alone would
        read the whole checkpoint); the mismatches of all."""
        if self.group is None:
            return store.checksum_problems(store.expected_checksums(path, manifest))
        dist.broadcast_object_list([("verify", str(path))], src=0, group=self.group)
        return self._my_share(path, manifest)

    def _serve_checksums(self) -> list[Any]:
        """Off rank 0: hash this rank's share of each candidate rank 0 names, until it
        sends the answer."""
        while True:
            message: list[Any] = [None]
            dist.broadcast_object_list(message, src=0, group=self.group)
            kind, body = message[0]
            if kind == "answer":
                return body
            manifest = store.read_manifest(Path(body))
            self._my_share(Path(body), manifest)

    def _my_share(self, path: Path, manifest: store.Manifest | None) -> list[str]:
        mine: list[str] = []
        if manifest is not None:
            share = store.expected_checksums(path, manifest, (self.rank, self.world))
            mine = store.checksum_problems(share)
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, mine, group=self.group)
        return [line for part in parts for line in part]

    def _find_on_main(self) -> tuple[str | None, list[str]]:
        resume = self.cfg.resume
        if resume == "never":
            if self.attempt == 0 and not self.lineage_started:
                self._start_lineage()
                return None, []
            resume = "auto"  # a restart or rollback resumes the lineage this launch started
        if resume != "auto":
            path = Path(resume)
            problems = store.verify(path, self.cfg.verify)  # one given checkpoint: rank 0
            if problems:
                raise CheckpointError(
                    f"checkpoint.resume = '{resume}' is not a valid checkpoint ({problems[0]}); "
                    "choose another with `trainwise checkpoints RUN`"
                )
            return self._own_or_allowed(path), []
        removed = store.clean_incomplete(self.root)
        for path in removed:
            self.log.warning("trainwise: removed an interrupted save: %s", path)
        best, skipped = store.find_latest_valid(
            self.root, self.cfg.verify, self.lineage, self._spread_checksums
        )
        notes = [f"{info.path.name}: {info.problems[0]}" for info in skipped]
        for info in skipped:
            append_event(
                self.run_dir, "checkpoint_skipped", path=str(info.path), problems=info.problems
            )
            self.log.warning(
                "trainwise: checkpoint %s is invalid and skipped: %s",
                info.path,
                "; ".join(info.problems),
            )
        if best is None and skipped:
            raise CheckpointError(
                f"no valid checkpoint in {self.root}: {len(skipped)} found, all invalid "
                f"({notes[0]}); set checkpoint.resume = 'never' to start a new lineage"
            )
        if best is None:  # none of this lineage: another run's, if any, by the rules
            other, _ = store.find_latest_valid(
                self.root, self.cfg.verify, checksums=self._spread_checksums
            )
            return (self._own_or_allowed(other.path) if other else None), notes
        return str(best.path), notes

    def _own_or_allowed(self, path: Path) -> str:
        """`path` when it is of this lineage or checkpoint.resume_from_other allows it;
        otherwise the one-line refusal naming the settings that differ."""
        found = differences(path, self.meta["lineage"])
        if found and self.cfg.resume_from_other == "no":
            raise refusal(path, found)
        self.other = bool(found)
        return str(path)

    def _start_lineage(self) -> None:
        """checkpoint.resume = 'never' on a new launch: earlier checkpoints move aside into
        previous/ (never deleted), so that resume and retention see this lineage only."""
        self.lineage_started = True
        moved = store.move_aside(self.root)
        if moved is not None:
            self.log.warning(
                "trainwise: checkpoint.resume = 'never': earlier checkpoints moved to %s", moved
            )
        # Always: the report tells a new lineage from a resume by this event.
        append_event(
            self.run_dir, "lineage", lineage=self.lineage, moved_to=moved and str(moved)
        )

    def load(self, path: Path) -> Resumed:
        """Load the states and the trainer's progress from `path` into this rank,
        resharding to the current layout and world size. From another lineage's checkpoint
        (checkpoint.resume_from_other) the weights, and with 'all' the optimizer state, are
        taken; this run's hyperparameters and schedule apply from its step on."""
        self.wait()  # the checkpoint group must be idle
        trainer = json.loads((path / TRAINER_FILE).read_text())
        taken = self.cfg.resume_from_other if self.other else "all"
        # RNG states are per rank: restored only at the same world size.
        same_world = trainer.get("world_size") == self.world and not self.other
        names = [MODEL] + ([OPTIMIZER] if taken == "all" else []) + ([RNG] if same_world else [])
        optimizer = self.states[OPTIMIZER]
        ours = optimizer.hyperparameters()  # type: ignore[attr-defined]
        optimizer.nested = OPTIMIZER in names and written_nested(path)  # type: ignore[attr-defined]
        try:
            self._read({name: self.states[name] for name in names}, path)
        finally:
            optimizer.nested = False  # type: ignore[attr-defined]  # saves: the flat format
        scheduler, scaler = self.progress["scheduler"], self.progress.get("scaler")
        if self.other:
            optimizer.set_hyperparameters(ours)  # type: ignore[attr-defined]
        # This run's schedule at the saved step: its own peak rates (the same as the
        # checkpoint's in one lineage), one a parameter group, however many the layout
        # makes (run/engine/optim.py: one a device mesh) and the checkpoint had.
        _continue_schedule(scheduler, trainer["scheduler"])
        if scaler is not None and trainer.get("scaler"):
            scaler.load_state_dict(trainer["scaler"])
        rng = "restored" if same_world else "kept (written by another world size)"
        self.last_save_step = trainer["step"]
        resumed = Resumed(trainer["step"], trainer["tokens"], path, [], rng, trainer)
        resumed.taken, resumed.other = taken, self.other
        return resumed

    def _read(self, state: dict[str, Any], path: Path) -> None:
        """DCP's load into `state`. A lost peer stays a peer failure (a restart fixes it);
        anything else (a shape that does not match the model) is one line, exit 2."""
        try:
            dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        except (Exception, CheckpointException) as err:  # the latter is a BaseException
            peer = find_peer_error(err)
            if peer is not None:
                raise PeerError(peer.cause, f"in the load of {path}: {peer}") from None
            failure = CheckpointError(
                f"the checkpoint {path} does not load into this job's model "
                f"({root_cause(err)}); resume it with the model "
                "it was written with, or set checkpoint.resume = 'never'"
            )
            failure.exit_status = 2
            raise failure from None

    def close(self) -> None:
        self.wait()
        self.stager.close()
        if self.own_group is not None:
            dist.destroy_process_group(self.own_group)
            self.own_group = None
        self.group = None


def _continue_schedule(scheduler: Any, saved: dict[str, Any]) -> None:
    """Take a saved position in the schedule (its step) but this run's peak rates, and set
    the optimizer's rates to where this schedule is at that step."""
    scheduler.load_state_dict({**saved, "base_lrs": list(scheduler.base_lrs)})
    rates = [
        base * factor(scheduler.last_epoch)
        for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(scheduler.optimizer.param_groups, rates, strict=True):
        group["lr"] = lr
    scheduler._last_lr = rates


def _save_error(step: int, tmp: Path, err: BaseException) -> CheckpointError:
    """One line for a failed save; disk-full named as such. The partial directory is left
    for the next start to clean; the previous checkpoint is untouched."""
    text = str(err).strip().splitlines()
    reason = text[-1] if text else type(err).__name__
    if disk_full(err, tmp.parent):
        reason = "no space left on the device"
    try:
        previous, _ = store.find_latest_valid(tmp.parent, "fast")
    except OSError:
        previous = None
    kept = (
        f"the previous checkpoint is intact ({previous.path.name}): free space or set "
        "checkpoint.dir, then run again to resume"
        if previous is not None
        else "no earlier checkpoint exists: free space or set checkpoint.dir, then run "
        "again (it starts over)"
    )
    return CheckpointError(
        f"checkpoint of step {step} could not be written to {tmp.parent} ({reason}); {kept}"
    )


DISK_FULL_FREE_BYTES = 1 << 20  # less free than this after a short write: the disk is full
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_TEXTS = ("no space left", "disk quota exceeded")
SHORT_WRITE_TEXTS = ("unexpected pos", "file write failed")  # torch's writer, errno lost


def disk_full(err: BaseException, folder: Path) -> bool:
    """ENOSPC or EDQUOT anywhere in the error (DCP wraps each rank's failure); or a short
    write in torch's file writer, which loses the errno, on a nearly full file system."""
    short_write = False
    for e in nested_errors(err):
        text = str(e).lower()
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        if any(t in text for t in DISK_FULL_TEXTS):
            return True
        short_write = short_write or any(t in text for t in SHORT_WRITE_TEXTS)
    if not short_write:
        return False
    try:
        return shutil.disk_usage(folder).free < DISK_FULL_FREE_BYTES
    except OSError:
        return False
