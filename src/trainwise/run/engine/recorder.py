"""From step results to records: when to probe, the split of a step into stages, the loss
averaged over ranks (one collective per flush, not per step), the metrics written on rank
0, and the totals behind the summary."""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch

from trainwise.config.schema import LoggingConfig
from trainwise.models.moe.load import step_load
from trainwise.plan.advisor import loader_fixes
from trainwise.plan.model.flops import mfu
from trainwise.run.engine.step import RankMean, StepResult
from trainwise.run.observe.telemetry import (
    STAGES,
    MetricsWriter,
    Progress,
    StepRecord,
    peak_memory,
    peak_reserved,
    read_metrics,
)
from trainwise.run.observe.trackers import Trackers

FIRST_PROBE_STEP = 3  # after the first steps' one-off costs (allocations, warm caches)
FIRST_PROBES = 3  # probes in a row at the start, so the first estimate is a median
DATA_WAIT_AFTER = 5  # steady steps before the data-wait share is judged
PROBE_WINDOW = 5  # exposed sync = median of the latest probes: one probe is noisy on CPU


def is_probe_step(step: int, probe_every: int) -> bool:
    """Probes run on a few steps in a row after warm-up, then every `probe_every` steps."""
    if not probe_every:
        return False
    first = FIRST_PROBE_STEP <= step < FIRST_PROBE_STEP + FIRST_PROBES
    return first or step % probe_every == 0


class Recorder:
    def __init__(
        self,
        *,
        steps: int,
        cfg: LoggingConfig,
        is_main: bool,
        run_dir: Path,
        distributed: bool,
        tokens_per_step: int,
        tokens_per_sample: int,
        flops_per_token: float | None,
        peak_flops_total: float | None,
        device: torch.device,
        start_step: int = 0,
        attempt: int = 0,
        num_workers: int = 0,
        trackers: Trackers | None = None,
        ep: int = 1,
    ):
        self.steps = steps
        self.start_step = start_step
        self.num_workers = num_workers  # the loader's, named in the data-wait warning
        self.attempt = attempt
        self.run_dir = run_dir
        self.cfg = cfg
        self.is_main = is_main
        self.probe_every = cfg.probe_every if distributed else 0
        self.tokens_per_step = tokens_per_step
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_token = flops_per_token
        self.peak = peak_flops_total
        self.device = device
        self.sync_estimate: float | None = None if distributed else 0.0
        self._probes: list[float] = []
        self._tp_probes: list[float] = []  # the TP collectives' part of those probes
        self.tp_total = 0.0  # their seconds over the steady steps (part of the sync)
        # Expert parallelism: the all-to-alls' seconds over the steady steps (part of the
        # sync too), and the steady steps' load figures (models.moe.load).
        self.a2a_total = 0.0
        self.ep = ep
        self.imbalances: dict[str, list[float]] = {"expert": [], "ep": []}
        self._pending: list[tuple[int, StepResult, float, float | None, float]] = []
        # A flush's reduction in flight: (it, its steps, the peak memory read then).
        self._reducing: tuple[Reduction, list, tuple] | None = None
        self.totals = dict.fromkeys(("step_s", *STAGES), 0.0)  # steady steps only
        self.steady_steps = 0
        self.data_warned = False
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.last_eval: float | None = None
        self.writer = MetricsWriter(run_dir, trackers, append=start_step > 0) if is_main else None
        show = is_main and cfg.progress != "none"
        self.progress = Progress(steps, cfg.progress, cfg.print_every) if show else None
        self.start = time.perf_counter()

    def profiled(self, step: int) -> bool:
        """In the traced window, or the step after it: every rank writes its trace then,
        and the slowest writer holds up that step's collectives."""
        window = self.cfg.profile_steps
        return bool(window) and window[0] <= step <= window[1] + 1

    def probe_now(self, step: int) -> bool:
        return is_probe_step(step - self.start_step, self.probe_every)

    def add(
        self,
        step: int,
        res: StepResult,
        lr: float,
        eval_loss: float | None = None,
        ckpt_s: float = 0.0,
    ) -> None:
        """Keep a step; every `flush_every` steps, at evaluations, saves and the end, average
        the losses over ranks in one collective and write the records. Every rank calls
        this at the same steps."""
        self.complete()  # the reduction issued after the previous step: this step hid it
        self._pending.append((step, res, lr, eval_loss, ckpt_s))
        # A step that saved (ckpt_s > 0) is written at once: a rerun resumes after it.
        due = step % self.cfg.flush_every == 0 or step == self.steps or ckpt_s > 0
        if due or eval_loss is not None:
            # With flush_every = 1 every record is asked for at its step (records that
            # outlive a kill); otherwise the collective overlaps the next step.
            self.flush(wait=ckpt_s > 0 or self.cfg.flush_every == 1)

    def make_durable(self) -> None:
        """Every record so far in metrics.jsonl, before a checkpoint commits its step: a
        write that failed (a full disk) stops the run here, so no checkpoint ever resumes
        past steps whose records are lost. Every rank calls it at the same step."""
        self.flush()
        if self.writer:
            self.writer.sync()

    def flush(self, wait: bool = True) -> None:
        """Issue the reduction of the kept steps (one collective); `wait`: complete it and
        write their records now, else at the next `add` or `complete`. Every rank calls
        this at the same steps."""
        self.complete()
        if not self._pending:
            return
        # The peak memory so far, read once for the records written together.
        memory = (*peak_memory(self.device), peak_reserved(self.device))
        reduction = Reduction([pending[1] for pending in self._pending])
        self._reducing = (reduction, self._pending, memory)
        self._pending = []
        if wait:
            self.complete()

    def complete(self) -> None:
        """Wait for the reduction in flight (if one is) and write its steps' records."""
        if self._reducing is None:
            return
        reduction, pending, memory = self._reducing
        self._reducing = None
        losses, auxes, tokens = reduction.result()
        records = [
            self._record(step, res, loss, norm, lr, eval_loss, ckpt_s, memory, aux, counts)
            for (step, res, lr, eval_loss, ckpt_s), loss, norm, aux, counts in zip(
                pending, losses, reduction.grad_norms(), auxes, tokens, strict=True)
        ]
        if self.is_main:
            # The lines first: the write wakes the writer thread, which would then hold the
            # GIL that the print takes back after its system call.
            if self.progress:
                for rec in records:
                    self.progress.update(rec)
            self.writer.write(*records)

    def _record(
        self,
        step: int,
        res: StepResult,
        loss: float,
        grad_norm: float,
        lr: float,
        eval_loss: float | None,
        ckpt_s: float,
        memory: tuple[int, str, int | None],
        aux_loss: float | None = None,
        tokens: list[list[float]] | None = None,
    ) -> StepRecord:
        spans, probe_sync = res.spans()
        tp_s = spans.get("tp")  # a probe step's tensor-parallel collectives (tp > 1)
        a2a_s = spans.get("a2a")  # expert parallelism's all-to-alls, every step
        if probe_sync is not None:
            # The exposed communication: the gradient sync the probe found, and the TP
            # collectives inside forward and backward (as the planner counts both).
            probe_sync += tp_s or 0.0
            self._probes = (self._probes + [probe_sync])[-PROBE_WINDOW:]
            self.sync_estimate = statistics.median(self._probes)
            if tp_s is not None:
                self._tp_probes = (self._tp_probes + [tp_s])[-PROBE_WINDOW:]
        data_s, optim_s = spans.get("data", 0.0), spans.get("optim", 0.0)
        compute = spans.get("compute", 0.0)
        if probe_sync is not None:
            sync = probe_sync  # this step's compute ran without communication
        else:
            sync = None if self.sync_estimate is None else min(self.sync_estimate, compute)
            compute -= sync or 0.0
        # The TP part of `sync`, from the latest probes as the sync itself on other steps.
        tp_part = min(statistics.median(self._tp_probes), sync or 0.0) if self._tp_probes else None
        if a2a_s is not None:  # out of compute already (StepResult.spans): exposed
            sync = (sync or 0.0) + a2a_s
        load = step_load(tokens, self.ep) if tokens is not None else None
        bubble = spans.get("bubble")  # a pipeline step's wait on the other stages
        step_s = data_s + compute + (bubble or 0.0) + (sync or 0.0) + optim_s + ckpt_s

        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.last_loss = loss
        if eval_loss is not None:
            self.last_eval = eval_loss
        profiled = self.profiled(step)
        warm = step >= self.start_step + FIRST_PROBE_STEP or self.steps < FIRST_PROBE_STEP
        if warm and not profiled:  # the profiler's own cost is no figure of the job
            self.steady_steps += 1
            values = (step_s, data_s, compute, bubble or 0.0, sync or 0.0, optim_s, ckpt_s)
            for key, value in zip(("step_s", *STAGES), values, strict=True):
                self.totals[key] += value
            self.tp_total += tp_part or 0.0
            self.a2a_total += a2a_s or 0.0
            if load is not None:
                self.imbalances["expert"].append(load.expert_imbalance)
                if load.ep_imbalance is not None:
                    self.imbalances["ep"].append(load.ep_imbalance)
            self._check_data_wait(step)
        mem, kind, reserved = memory
        tps = self.tokens_per_step / step_s if step_s > 0 else 0.0
        use_mfu = self.peak and self.flops_per_token
        return StepRecord(
            step=step, loss=loss, eval_loss=eval_loss, lr=lr, grad_norm=grad_norm,
            step_s=step_s, data_s=data_s, compute_s=compute, sync_s=sync, optim_s=optim_s,
            ckpt_s=ckpt_s, tp_s=tp_part, bubble_s=bubble,
            tokens=step * self.tokens_per_step, tokens_per_s=tps,
            samples_per_s=tps / self.tokens_per_sample,
            mfu=mfu(tps, self.flops_per_token, self.peak) if use_mfu else None,
            mem_bytes=mem, mem_kind=kind, elapsed_s=res.end - self.start, time=time.time(),
            attempt=self.attempt, profiled=profiled,
            mem_reserved_bytes=reserved, aux_loss=aux_loss, a2a_s=a2a_s,
            expert_tokens=load.tokens if load else None,
            expert_imbalance=load.expert_imbalance if load else None,
            ep_imbalance=load.ep_imbalance if load else None,
        )

    def _check_data_wait(self, step: int) -> None:
        """Warn once (rank 0) when the steady steps so far waited for data more than
        logging.data_wait_warn of their time."""
        limit = self.cfg.data_wait_warn
        if self.data_warned or not limit or self.steady_steps < DATA_WAIT_AFTER:
            return
        share = self.totals["data_s"] / (self.totals["step_s"] or 1.0)
        if share <= limit:
            return
        self.data_warned = True
        if self.is_main:
            logging.getLogger("trainwise").warning(
                "trainwise: step %d: the workers waited for data %.0f%% of the time so far "
                "(logging.data_wait_warn = %g); %s", step, 100 * share, limit,
                loader_fixes(self.num_workers, self.device.type == "cuda"),
            )

    def finish(self) -> dict:
        """Flush, close the writers; the figures of the summary."""
        self.flush()
        if self.progress:
            self.progress.close()
        if self.writer:
            self.writer.close()
        timed = self.totals["step_s"]
        figures = {
            "first_loss": self.first_loss,
            "final_loss": self.last_loss,
            "final_eval_loss": self.last_eval,
            # None, not 0, when no steady step was timed: nothing was measured.
            "tokens_per_s": self.steady_steps * self.tokens_per_step / timed if timed else None,
            "tokens_per_sample": self.tokens_per_sample,
            "stage_share": {k.removesuffix("_s"): self.totals[k] / timed for k in STAGES}
            if timed
            else {},
            "sync_measured": self.probe_every > 0,
            # The tensor-parallel collectives' share of the step (inside the exposed sync).
            "tp_comm_share": self.tp_total / timed if timed and self._tp_probes else None,
            # Expert parallelism's all-to-alls' share of the step (inside the exposed sync),
            # and the steady steps' median load figures (ep_imbalance: the planner's
            # moe.imbalance, measured; models.moe.load).
            "a2a_share": self.a2a_total / timed if timed and self.ep > 1 else None,
            "expert_imbalance": _median(self.imbalances["expert"]),
            "ep_imbalance": _median(self.imbalances["ep"]),
        }
        if not self.is_main:
            return figures
        if self.first_loss is None:  # no step in this attempt: what the run measured stands
            figures.update(earlier_figures(self.run_dir, figures))
        figures.update(run_losses(read_metrics(self.run_dir)))
        return figures


def reduce_steps(
    results: list[StepResult],
) -> tuple[list[float], list[float | None], list[list[list[float]] | None]]:
    """The steps' losses and their auxiliary parts, averaged over the ranks, and a MoE
    model's tokens per expert per layer summed over them (each rank routes its own tokens,
    a tensor-parallel rank its 1 / tp of its group's), in one collective; None where a
    step has none (every rank alike)."""
    return Reduction(results).result()


class Reduction:
    """reduce_steps' collective (a RankMean), issued at construction without waiting;
    `result` waits for it and reads the values. The steps' gradient norms (global already,
    the same on every rank) are read beside it in one host read (`grad_norms`), not one
    per step (on a GPU each read is a synchronisation)."""

    def __init__(self, results: list[StepResult]):
        self.norms = torch.stack([r.grad_norm.detach().float().reshape(()) for r in results])
        pieces = [torch.stack([r.loss.float() for r in results])]
        self.has_aux = [r.aux_loss is not None for r in results]
        pieces += [r.aux_loss.float().reshape(1) for r in results if r.aux_loss is not None]
        self.shapes = [
            r.expert_tokens.shape if r.expert_tokens is not None else None for r in results
        ]
        pieces += [
            r.expert_tokens.float().reshape(-1) for r in results if r.expert_tokens is not None
        ]
        self.n = len(results)
        self.mean = RankMean(torch.cat(pieces))

    def grad_norms(self) -> list[float]:
        """The steps' gradient norms, in order."""
        return self.norms.tolist()

    def result(self) -> tuple[list[float], list[float | None], list[list[list[float]] | None]]:
        means, world = self.mean.result(), self.mean.world
        losses, rest = means[: self.n], iter(means[self.n:])
        auxes = [next(rest) if has else None for has in self.has_aux]
        tokens = []
        for shape in self.shapes:
            if shape is None:
                tokens.append(None)
                continue
            flat = [next(rest) * world for _ in range(shape[0] * shape[1])]
            tokens.append([flat[i * shape[1]:(i + 1) * shape[1]] for i in range(shape[0])])
        return losses, auxes, tokens


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_losses(records: list[dict]) -> dict:
    """The losses of the whole run, from its records: a resumed attempt's own first loss is
    not the run's. Each step counts as its last attempt ran it."""
    kept = {r["step"]: r for r in records if isinstance(r.get("loss"), (int, float))}
    if not kept:
        return {}
    steps = sorted(kept)
    evals = [kept[s]["eval_loss"] for s in steps if kept[s].get("eval_loss") is not None]
    return {
        "first_loss": kept[steps[0]]["loss"],
        "final_loss": kept[steps[-1]]["loss"],
        "final_eval_loss": evals[-1] if evals else None,
    }


def earlier_figures(run_dir: Path, keys: dict) -> dict:
    """The figures (of `keys`) that the run's summary.json already holds, where set."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(summary, dict):
        return {}
    return {k: summary[k] for k in keys if summary.get(k) is not None}
