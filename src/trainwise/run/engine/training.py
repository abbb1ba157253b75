"""One worker's training, as named steps: resume, a training step, maybe evaluate, agree on
stop and save, judge the non-finite verdicts, save, on a peer failure, finish.
`Training.run` only sequences them (torchtitan's `Trainer.train` calls `train_step` and
`checkpointer.save` the same way); the components are built once in `Training.__init__`."""

from __future__ import annotations

import gc
import json
import logging
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainwise.config import JobConfig
from trainwise.data import build_eval_loader, build_loader
from trainwise.errors import TrainwiseError
from trainwise.faults import Faults
from trainwise.models.lora import lora_line
from trainwise.run.checkpoint import store as store
from trainwise.run.checkpoint.dcp import Resumed
from trainwise.run.checkpoint.store import CheckpointError
from trainwise.run.engine.control import Control
from trainwise.run.engine.guard import Verdicts
from trainwise.run.engine.host_allocator import keep_freed_host_memory
from trainwise.run.engine.recorder import Recorder
from trainwise.run.engine.step import StepResult
from trainwise.run.engine.trainer import build_checkpointer, build_trainer
from trainwise.run.job.distributed import DistEnv, host_group, job_store, network_line
from trainwise.run.job.lifeline import this_launch
from trainwise.run.job.resolve import Job
from trainwise.run.observe.events import append_event, read_events, resumptions, retry_cost
from trainwise.run.observe.hang import StepWatchdog, write_hang_dump
from trainwise.run.observe.peers import BARRIER_S, PeerFailure, absent_ranks, classify, last_line
from trainwise.run.observe.profiling import Profiler
from trainwise.run.observe.telemetry import mark_memory_baseline
from trainwise.run.observe.trackers import Trackers, build_trackers
from trainwise.run.observe.wall import wall_of

MAX_ROLLBACKS = 3


class GuardError(TrainwiseError):
    """The non-finite guard stopped the run (policy stop, or too many skips/rollbacks)."""


class Training:
    """The job's components on this worker and the loop over them."""

    def __init__(
        self, cfg: JobConfig, job: Job, env: DistEnv, device: torch.device, run_dir: Path,
        log: logging.Logger,
    ):
        self.cfg, self.job, self.env, self.device = cfg, job, env, device
        self.run_dir, self.log = run_dir, log
        self.faults = Faults.from_env(env.rank, run_dir, env.attempt)
        if keep_freed_host_memory(device.type):  # a CPU step's buffers: no page faults a step
            log.debug("glibc's malloc keeps freed memory (run/engine/host_allocator.py)")
        mark_memory_baseline()  # what the job adds over it is compared with the plan
        self.trainer = build_trainer(cfg, job, device, faults=self.faults)
        self.train_ds = self.faults.data(job.datasets[0])
        self.distributed = dist.is_initialized()
        timeout = cfg.parallel.timeout_s
        # The control flags and the checkpoint's collectives (main thread, program order);
        # a process alone (a group of one) agrees with nobody.
        peers = self.distributed and env.world > 1
        host = host_group(timeout) if peers else None
        self.ckpt = build_checkpointer(cfg, job, env, device, run_dir, self.trainer, log, host)
        self.ckpt.before_commit = self.faults.in_save
        # Under a launcher, the launcher says what a second signal did (once, not per rank).
        self.control = Control(
            host, announce_second=this_launch() is None, every=cfg.logging.flush_every
        )
        # For diagnosis: after a timed-out collective the survivors meet on the job's
        # rendezvous store to find which ranks are missing (peers.absent_ranks).
        self.store = job_store() if peers else None
        self.watchdog = StepWatchdog(timeout) if self.distributed else None
        self.data_state = {"global_batch": job.global_batch, "seed": cfg.train.seed}
        self.step = 0
        self.stage = "start-up"  # where a failed collective was: named in its message
        self.skips_in_a_row = 0
        self.rollbacks = 0
        self.verdicts = Verdicts()  # the non-finite guard's, read without waiting on the device
        self.preempted: str | None = None
        self.stopped_unsaved = False  # a stop met a rollback: the run is at that checkpoint
        self.resumed = Resumed()
        self.profiler = Profiler(cfg.logging.profile_steps, run_dir, env.rank, device)
        self.recorder: Recorder | None = None
        self.trackers: Trackers | None = None
        self.batches: Any = None

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> dict[str, Any] | None:
        """Train to train.steps (or a stop signal); the summary on rank 0."""
        self.resume()
        self.control.install()
        # What is built by now lives as long as the run: out of the collector's sight, so
        # that a full collection (a checkpoint save's garbage sets one off) walks only what
        # the loop made since, not torch's and the job's 300,000 objects (0.6 s on 2 cores).
        gc.freeze()
        failed = False
        try:
            while self.step < self.cfg.train.steps:
                self.step += 1
                result = self.train_step()
                eval_loss = self.maybe_evaluate()
                stop, save = self.agree()
                # The guard acts on the verdicts in: a step's is in one step later where its
                # update skipped itself on the device; at once before a save and at the end.
                if self.judge(now=save or self.step == self.cfg.train.steps):
                    if stop:  # the run is at its checkpoint already: nothing to save
                        self.preempted = self.control.signal_name or "signal"
                        self.stopped_unsaved = True
                        break
                    continue  # rolled back: self.step is the checkpoint's
                stall = self.save(stop) if save else 0.0
                self.stage = "the metrics reduction"
                self.recorder.add(self.step, result, self.lr(), eval_loss, ckpt_s=stall)
                self.profiler.after_step(self.step)
                self.faults.after_step(self.step, until=self.stopping)
                if stop:
                    self.preempted = self.control.signal_name or "signal"
                    break
            self.stage = "the last checkpoint save"
            self.ckpt.close()
        except torch.OutOfMemoryError:
            self.profiler.on_oom()
            raise
        except RuntimeError as err:
            failed = classify(err) is not None and self.distributed
            if not failed:
                raise
            self.on_peer_failure(err)
        finally:
            gc.unfreeze()
            if self.watchdog:
                self.watchdog.disarm()
            if failed:
                self.control.uninstall()  # the groups may be wedged: no drain, no destroy
            else:
                self.control.close()
        return self.finish()

    # -- the named steps --------------------------------------------------------------

    def resume(self) -> None:
        """Load the newest valid checkpoint of the run's lineage (or none), the same on
        every rank; say where the run continues from; set up the data and the recorder."""
        c, env = self.cfg, self.env
        path, skipped = self.ckpt.find()
        self.resumed = self.ckpt.load(path) if path else Resumed()
        if path:
            self.trainer.weights_set()
        self.resumed.skipped = skipped
        self.log.info("trainwise: %s", self.resumed.line())  # first: where it continues from
        if (stop := self._previous_stop()) is not None:
            self.log.info("trainwise: %s", stop)
        self.log.info(
            "trainwise: %s on %d x %s (%s), %s", c.model.name, env.world,
            self.job.device.name, self.job.dims.describe(), self.job.decision.reason,
        )
        if c.lora.rank:
            self.log.info("trainwise: %s", lora_line(self.trainer.parts))
        if env.world > 1:
            self.log.info(
                "trainwise: %d machine(s) x %d workers, %s",
                env.world // max(env.local_world, 1), env.local_world, network_line(),
            )
        if env.is_main and path:
            append_event(
                self.run_dir, "resume", attempt=env.attempt, step=self.resumed.step,
                path=str(path), rng=self.resumed.rng, skipped=skipped,
                from_world=self.resumed.trainer.get("world_size"),
                from_strategy=self.resumed.trainer.get("strategy"),
            )
        self._check_data(path)
        self.step = self.resumed.step
        self.batches = self.batches_from(self.step, self._saved_data(self.resumed))
        self.trackers = self._build_trackers() if env.is_main else None
        self.recorder = self._build_recorder()
        if env.is_main:
            record_membership(self.run_dir, env, self.step)

    def _previous_stop(self) -> str | None:
        """After a planned stop (a requeue, a rerun after Ctrl-C): how long the run waited
        and how many steps it trains again. Rank 0, first attempt of a launch."""
        if not self.env.is_main or self.env.attempt:
            return None
        found = resumptions(read_events(self.run_dir))
        last = found[-1] if found else None
        if last is None or last.waited_s is None or last.resumed_step is not None:
            return None  # none, or the last one was resumed by an earlier launch
        if last.new_lineage and not self.ckpt.lineage_started:
            return None  # an earlier launch started the new lineage and said so
        return replace(
            last, resumed_step=self.resumed.step, new_lineage=self.ckpt.lineage_started
        ).line()

    def train_step(self) -> StepResult:
        self.stage = "the training step"
        if self.watchdog:
            self.watchdog.arm()  # it fires on a step that runs about as long as timeout_s
        self.faults.before_step(self.step, until=self.stopping)
        self.profiler.before_step(self.step)
        self.trainer.step.poison = self.faults.poisons(self.step)
        result = self.trainer.train_step(self.batches, probe=self.recorder.probe_now(self.step))
        self.profiler.end_step()
        self.verdicts.add(self.step, result.finite)
        return result

    def judge(self, now: bool) -> bool:
        """The guard on the verdicts in (`now`: every one, waiting for the device):
        True where a non-finite step rolled the run back."""
        self.stage = "the non-finite guard's read"  # a device error of the step shows here
        for step, finite in self.verdicts.take(now):
            if finite:
                self.skips_in_a_row = 0
            elif self.on_nonfinite(step):
                self.verdicts.clear()  # the steps after it are undone
                return True
        return False

    def on_nonfinite(self, step: int) -> bool:
        """The guard, by train.nonfinite, for a step whose gradient norm was not finite
        (its update skipped): go on (False), roll back to the last checkpoint (True: the
        loop goes on from there), or stop with a GuardError."""
        policy = self.cfg.train.nonfinite
        self.skips_in_a_row += 1
        if self.env.is_main:
            append_event(self.run_dir, "nonfinite", step=step, policy=policy)
        self.log.warning("trainwise: step %d: non-finite loss or gradient norm (%s)", step, policy)
        if policy == "stop" or self.skips_in_a_row > self.cfg.train.max_skips:
            raise GuardError(
                f"step {step}: non-finite loss or gradient norm"
                + (f" {self.skips_in_a_row} steps in a row" if policy != "stop" else "")
                + f" (train.nonfinite = '{policy}'): lower optim.lr, raise "
                "train.grad_clip or check the data; the last checkpoint is intact"
            )
        if policy != "rollback":
            return False
        self.stage = "the rollback"
        resumed = self._rollback(step)
        self.step = resumed.step
        self.rollbacks += 1
        self.batches = self.batches_from(self.step, self._saved_data(resumed))
        if self.env.is_main:
            append_event(self.run_dir, "rollback", to_step=self.step)
        return True

    def maybe_evaluate(self) -> float | None:
        every, step = self.cfg.train.eval_every, self.step
        if every <= 0 or (step % every and step != self.cfg.train.steps):
            return None
        if self.job.datasets[1] is None:  # an iterable without a validation split
            return None
        self.stage = "evaluation"
        return self.trainer.evaluate(self.eval_batches())

    def agree(self) -> tuple[bool, bool]:
        """Agree on stop / save-now with every rank: (stop, save at this step). A stop
        always saves."""
        ckpt, step = self.ckpt, self.step
        if self.env.is_main and ckpt.wanted(step):
            self.control.request_save()
        self.stage = "the exchange of control flags"
        stop, save_now = self.control.exchange(step)
        return stop, (stop or save_now or ckpt.due(step)) and (ckpt.cfg.enabled or stop)

    def save(self, stop: bool) -> float:
        """Save this step (synchronously for a stop); returns the loop's stall in seconds."""
        self.stage = "the metrics reduction"
        self.recorder.make_durable()  # no checkpoint past steps whose records are lost
        self.stage = "the checkpoint save"
        step = self.step
        tokens = step * self.job.tokens_per_step
        return self.ckpt.save(step, tokens, time.time(), self.data_position(), sync=stop)

    def on_peer_failure(self, err: RuntimeError) -> None:
        """A collective failed because of another rank: one line and an event, then exit
        1 for the agent to restart the group (or 0 when a peer ended the launch for good)."""
        launch = this_launch()
        if launch is not None and launch.fatal():
            raise SystemExit(0) from None  # a peer stopped the run for good: it reports why
        kind = classify(err)
        where = self.trainer.step.stage if self.stage == "the training step" else self.stage
        timeout = self.cfg.parallel.timeout_s
        # A hang needs the diagnosis; a lost peer exited, and the agent reports which (no
        # need to hold up the restart by a barrier).
        absent = None
        if kind == "timeout":
            key = f"{self.env.attempt}/{self.step}"
            absent = absent_ranks(self.store, self.env.rank, self.env.world, key,
                                  min(BARRIER_S, timeout))
        failure = PeerFailure(self.step, where, self.env.rank, kind, absent, last_line(err))
        line = failure.line(timeout)
        self.log.error("trainwise: %s", line)
        trace = "".join(traceback.format_exception(err))  # kept for a post-mortem
        stuck = self.watchdog.stacks() if self.watchdog else ""
        after = self.watchdog.taken_after() if self.watchdog else timeout
        dump = write_hang_dump(self.run_dir, self.env.rank, line, trace, stuck, after)
        append_event(
            self.run_dir, "peer_failure", **asdict(failure), message=line, traceback=trace,
            dump=str(dump.relative_to(self.run_dir)),
        )
        raise SystemExit(1) from None  # no traceback: the line says it; the agent restarts

    def finish(self) -> dict[str, Any] | None:
        """The run's last event and, on rank 0, its summary (summary.json)."""
        self.profiler.stop()  # a run that ended inside the traced window
        figures = self.recorder.finish()
        env, step = self.env, self.step
        if self.preempted:
            self.log.info(
                "trainwise: preempted (%s) after step %d; %s", self.preempted, step,
                "rolled back to its checkpoint, nothing saved" if self.stopped_unsaved
                else "checkpoint saved",
            )
            if env.is_main:
                saved = store.final_dir(self.ckpt.root, self.ckpt.last_save_step)
                append_event(
                    self.run_dir, "preempted", step=step, signal=self.preempted,
                    checkpoint=str(saved),
                )
        elif env.is_main:
            append_event(self.run_dir, "finish", step=step)
        if not env.is_main:
            return None
        summary = self._summary(figures)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.trackers.finish(read_events(self.run_dir), finished=not self.preempted)
        return summary

    # -- helpers ----------------------------------------------------------------------

    def stopping(self) -> bool:
        return self.control.signal is not None

    def lr(self) -> float:
        return self.trainer.scheduler.get_last_lr()[0]

    def batches_from(self, step: int, saved: dict[str, Any] | None = None) -> Any:
        # The sampler's stream depends on (seed, global batch, step) only, an iterable's
        # position on the samples of the steps before: the same samples follow step `step`
        # whatever the number of ranks (resharding skips and repeats none). `saved`: the
        # checkpoint's data position, whose stream state restores an iterable dataset.
        c, t = self.cfg, self.trainer
        loader = build_loader(
            self.train_ds, micro_batch=c.data.micro_batch, grad_accum=self.job.grad_accum,
            dp_rank=t.dp_rank, dp_size=t.dp_size, seed=c.train.seed, start_step=step,
            num_steps=c.train.steps - step, num_workers=c.data.num_workers,
            pin_memory=c.data.pin_memory and self.device.type == "cuda",
            prefetch_factor=c.data.prefetch_factor, position=saved,
        )
        if getattr(loader, "resumed", None):
            self.log.info("trainwise: data: the stream %s", loader.resumed)
        return iter(loader)

    def data_position(self) -> dict[str, Any]:
        """What a checkpoint records of the data: the run's (global batch, seed), the
        samples consumed, and an iterable's own state where it has one (data/stream.py)."""
        position = getattr(self.batches, "position", None)
        if position is not None:
            return {**self.data_state, **position()}
        return {**self.data_state, "samples": self.step * self.job.global_batch}

    def _saved_data(self, resumed: Resumed) -> dict[str, Any] | None:
        """A loaded checkpoint's data position (none from another lineage's checkpoint)."""
        return None if resumed.other else resumed.trainer.get("data")

    def eval_batches(self) -> Any:
        c, t = self.cfg, self.trainer
        return build_eval_loader(
            self.job.datasets[1], micro_batch=c.data.micro_batch,
            max_batches=c.train.eval_batches, dp_rank=t.dp_rank, dp_size=t.dp_size,
            seed=c.train.seed,
        )

    def _check_data(self, path: Path | None) -> None:
        data = self.resumed.trainer.get("data", self.data_state)
        saved = {key: data.get(key) for key in self.data_state}  # less the position
        if not self.resumed.other and saved != self.data_state:
            raise CheckpointError(
                f"the checkpoint at {path} was written with data {saved} but this run has "
                f"{self.data_state}; resume with the same global batch and seed, or set "
                "checkpoint.resume = 'never'"
            )

    def _build_recorder(self) -> Recorder:
        c, job, env = self.cfg, self.job, self.env
        peak = job.device.peak_flops(c.precision.dtype)
        return Recorder(
            steps=c.train.steps, cfg=c.logging, is_main=env.is_main, run_dir=self.run_dir,
            distributed=not job.dims.single and env.world > 1,
            tokens_per_step=job.tokens_per_step,
            tokens_per_sample=job.data.tokens_per_sample, flops_per_token=job.flops_per_token,
            peak_flops_total=peak * env.world if peak else None, device=self.device,
            start_step=self.step, attempt=env.attempt, num_workers=c.data.num_workers,
            trackers=self.trackers, ep=job.dims.ep,
        )

    def _build_trackers(self) -> Trackers:
        c = self.cfg.logging
        return build_trackers(
            c.trackers, self.run_dir, self.cfg.model_dump(mode="json"), mlflow_uri=c.mlflow_uri,
            tensorboard_every=c.tensorboard_every, wrap=self.faults.tracker,
        )

    def _rollback(self, step: int) -> Resumed:
        """Reload the newest valid checkpoint in place after non-finite `step`; returns it
        (its step: where the run continues)."""
        if self.rollbacks >= MAX_ROLLBACKS:
            raise GuardError(
                f"step {step}: still non-finite after {self.rollbacks} rollbacks: the fault "
                "repeats from the checkpoint; lower optim.lr or check the data"
            )
        path, _ = self.ckpt.find()
        if path is None:
            raise GuardError(
                f"step {step}: non-finite loss and no checkpoint to roll back to: save earlier "
                "(checkpoint.interval) or use train.nonfinite = 'skip'"
            )
        resumed = self.ckpt.load(path)
        self.trainer.weights_set()
        self.log.warning(
            "trainwise: step %d: rolled back to step %d (%s)", step, resumed.step, path
        )
        return resumed

    def _summary(self, figures: dict[str, Any]) -> dict[str, Any]:
        c, job, env, resumed = self.cfg, self.job, self.env, self.resumed
        cost = retry_cost(read_events(self.run_dir), env.world)
        trainable, total = job.lora_counts
        return {
            "run_dir": str(self.run_dir),
            "model": c.model.name,
            "params": job.params,
            "trainable_params": trainable,
            "total_params": total,
            "strategy": job.strategy,
            "layout": job.dims.describe(),
            "tp": job.dims.tp,
            "pp": job.dims.pp,
            "cpu_offload": job.cpu_offload,
            "reason": job.decision.reason,
            "world": env.world,
            "device": job.device.name,
            "precision": c.precision.dtype,
            "steps": c.train.steps,
            "last_step": self.step,
            "preempted": self.preempted,
            "resumed_from": resumed.step if resumed.path else None,
            "resume": resumed.line(),
            "global_batch": job.global_batch,
            "tokens": self.step * job.tokens_per_step,
            "retry_cost": asdict(cost),
            "retry_line": cost.summary_line(),
            **figures,
            # The report's definition (launches summed, start-up included): one wall figure.
            "wall_s": wall_of(self.run_dir),
        }


def record_membership(run_dir: Path, env: DistEnv, step: int) -> None:
    """The `ready` event of this attempt, after a `membership` event when the job now runs
    on a different number of workers than its previous attempt (an elastic range lost or
    gained machines)."""
    nodes = env.world // max(env.local_world, 1)
    attempt = env.attempt
    before = [e for e in read_events(run_dir) if e["kind"] == "ready"]
    if before and before[-1].get("world") not in (None, env.world):
        last = before[-1]
        append_event(
            run_dir, "membership", attempt=attempt, step=step, from_world=last["world"],
            world=env.world, from_nodes=last.get("nodes"), nodes=nodes,
        )
    append_event(run_dir, "ready", attempt=attempt, step=step, world=env.world, nodes=nodes)
