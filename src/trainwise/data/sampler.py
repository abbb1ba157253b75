"""ShardedBatchSampler: which sample ids each data-parallel rank reads at each step.

The sample order is one infinite stream, the concatenation of per-epoch permutations of
range(num_samples). Step s takes the global batch at stream positions [s*G, (s+1)*G), with
G = micro_batch * grad_accum * dp_size, and rank r's micro-batch a is the slice
[(r*grad_accum + a)*micro_batch, +micro_batch) of it. Ranks read disjoint shards, and the
union over ranks and micro-batches of a step depends only on (seed, G, step). That is what
makes single-process, DDP and FSDP runs with the same global batch see identical data, and
lets a run resume on another number of ranks as long as G stays the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from trainwise.errors import DataError

_SHAPE_KEYS = ("num_samples", "global_batch", "seed", "shuffle")
_EPOCH_CACHE = 2  # a micro-batch spans at most two epochs since G <= num_samples


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DataError(f"{name}={value!r} must be an integer >= 1")
    return value


def _non_negative(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DataError(f"{name}={value!r} must be an integer >= 0")
    return value


class ShardedBatchSampler(Sampler[list[int]]):
    """Batch sampler for a DataLoader: yields this rank's micro-batches step by step.

    Every iteration is one pass over steps [begin, start_step + num_steps), or from begin
    forever when num_steps is None; begin is start_step, or the step load_state_dict
    restored. So a finite loader can be iterated again (e.g. for each evaluation) and
    yields the same batches. While iterating, the sampler tracks its position: the step of
    the next micro-batch not yet yielded, so a step cut off after some of its micro-batches
    is replayed whole on resume. A DataLoader with workers draws from the sampler ahead of
    the training loop (prefetch), so checkpoint the trainer's own step and restore it with
    load_state_dict (or start_step) rather than saving a running sampler's state.
    """

    def __init__(
        self,
        num_samples: int,
        micro_batch: int,
        grad_accum: int,
        dp_rank: int,
        dp_size: int,
        seed: int = 0,
        start_step: int = 0,
        num_steps: int | None = None,
        shuffle: bool = True,
    ):
        super().__init__()
        self.num_samples = _positive("num_samples", num_samples)
        self.micro_batch = _positive("data.micro_batch", micro_batch)
        self.grad_accum = _positive("data.grad_accum", grad_accum)
        self.dp_size = _positive("dp_size", dp_size)
        if not isinstance(dp_rank, int) or isinstance(dp_rank, bool) or not 0 <= dp_rank < dp_size:
            raise DataError(
                f"dp_rank={dp_rank!r} must be in 0..{dp_size - 1} for dp_size={dp_size}"
            )
        self.dp_rank = dp_rank
        self.seed = _non_negative("data seed", seed)
        self.start_step = _non_negative("start_step", start_step)
        if num_steps is not None:
            _non_negative("num_steps", num_steps)
        self.num_steps = num_steps
        self.shuffle = bool(shuffle)
        self.global_batch = self.micro_batch * self.grad_accum * self.dp_size
        if self.global_batch > self.num_samples:
            raise DataError(
                f"global batch {self.global_batch} = micro_batch {self.micro_batch} x grad_accum "
                f"{self.grad_accum} x dp {self.dp_size} exceeds the {self.num_samples} samples of "
                "the dataset; lower data.micro_batch or data.grad_accum (or use more data)"
            )
        self._begin = self.start_step
        self._step = self.start_step
        self._perms: dict[int, np.ndarray] = {}

    # -- the pure mapping -------------------------------------------------------------

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                perm = np.arange(self.num_samples)
            if len(self._perms) >= _EPOCH_CACHE:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def _stream(self, start: int, count: int) -> list[int]:
        """Sample ids at stream positions [start, start + count), across epoch boundaries."""
        out: list[int] = []
        while count > 0:
            epoch, offset = divmod(start, self.num_samples)
            take = min(count, self.num_samples - offset)
            out.extend(self._perm(epoch)[offset : offset + take].tolist())
            start += take
            count -= take
        return out

    def indices(self, step: int, micro: int) -> list[int]:
        """Sample ids of this rank's micro-batch `micro` (0..grad_accum-1) at `step`."""
        _non_negative("step", step)
        if not isinstance(micro, int) or not 0 <= micro < self.grad_accum:
            raise DataError(f"micro={micro!r} must be in 0..{self.grad_accum - 1}")
        offset = (self.dp_rank * self.grad_accum + micro) * self.micro_batch
        return self._stream(step * self.global_batch + offset, self.micro_batch)

    # -- iteration and position -------------------------------------------------------

    def _stop(self) -> int | None:
        return None if self.num_steps is None else self.start_step + self.num_steps

    def __iter__(self) -> Iterator[list[int]]:
        stop = self._stop()
        self._step = self._begin
        while stop is None or self._step < stop:
            step = self._step
            for micro in range(self.grad_accum):
                batch = self.indices(step, micro)
                if micro == self.grad_accum - 1:
                    # The step is fully handed out; the next micro-batch belongs to step + 1.
                    self._step = step + 1
                yield batch

    def __len__(self) -> int:
        """Micro-batches one pass yields: num_steps * grad_accum (fewer after load_state_dict
        moved begin forward); TypeError for an infinite sampler."""
        stop = self._stop()
        if stop is None:
            raise TypeError("ShardedBatchSampler with num_steps=None is infinite and has no len")
        return max(0, stop - self._begin) * self.grad_accum

    def state_dict(self) -> dict[str, Any]:
        """Position (the step to resume at) plus the fields that must match on load."""
        return {
            "step": self._step,
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "dp_size": self.dp_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position: later passes begin at its step. num_samples, global
        batch, seed and shuffle must match; the split of the global batch into
        micro_batch x grad_accum x dp may differ (e.g. resuming on fewer ranks)."""
        missing = [k for k in ("step", *_SHAPE_KEYS) if k not in state]
        if missing:
            raise DataError(
                f"sampler state is missing {', '.join(missing)}; pass a dict from state_dict()"
            )
        mine = self.state_dict()
        problems = []
        for key in _SHAPE_KEYS:
            if state[key] != mine[key]:
                how = " (micro_batch x grad_accum x dp)" if key == "global_batch" else ""
                problems.append(
                    f"sampler state: {key} is {state[key]!r} in the checkpoint but {mine[key]!r} "
                    f"now; resume with the same {key}{how} or start a fresh run"
                )
        if problems:
            raise DataError(problems)
        self._begin = self._step = _non_negative("sampler state step", state["step"])
