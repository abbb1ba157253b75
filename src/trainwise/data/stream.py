"""An iterable dataset read as one global stream by every data-parallel rank.

Every rank walks the same sequence of samples (epoch after epoch; `set_epoch(e)` first
where the dataset has it, as a Hugging Face IterableDataset does) and takes G =
micro_batch x grad_accum x dp samples a step; rank r's micro-batch a is the slice
[(r*grad_accum + a)*micro_batch, +micro_batch) of them: ShardedBatchSampler's rule, on a
stream instead of a permutation. So step s trains on stream positions [s*G, (s+1)*G)
whatever the number of ranks, and the position after step s is s*G samples. The price:
each rank reads (and decodes) every sample and collates only its own.

The position goes into the checkpoint. A resume restores it through the dataset's own
`state_dict()` / `load_state_dict()` where it has them and they are exact (a Hugging Face
stream without a shuffle buffer: its shard and the example inside it); otherwise it reads
the stream again from its start and skips the samples already trained on. Both assume the
stream is the same each time it is read (a seeded shuffle, no unseeded randomness).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from trainwise.data.batch import Batch
from trainwise.errors import DataError


class Stream:
    """An iterable dataset as trainwise reads it. `source` is read again for each pass
    (an IterableDataset), or `factory()` makes each pass (a function returning a
    generator); `batch_of` makes a batch of a list of samples (data.collate, then the
    step's tuple); `stateful`: its state_dict() resumes it exactly (else: replay)."""

    def __init__(
        self,
        what: str,
        batch_of: Callable[[list[Any]], Batch],
        *,
        source: Any = None,
        factory: Callable[[], Any] | None = None,
        stateful: bool = False,
    ):
        if (source is None) == (factory is None):
            raise ValueError("a Stream reads a source or calls a factory, one of them")
        self.what = what  # "data.dataset = 'pkg.mod:attr'", for messages
        self.batch_of = batch_of
        self.source = source
        self.factory = factory
        self.stateful = stateful and source is not None

    def samples(self, epoch: int) -> Iterator[Any]:
        """One pass over the stream: its epoch `epoch`."""
        if self.factory is not None:
            return iter(self.factory())
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)
        return iter(self.source)

    def state(self, epoch: int) -> dict[str, Any] | None:
        """The dataset's own state where it resumes exactly (JSON, for trainer.json). A
        copy: an async save writes it after later steps have moved the dataset on."""
        if not self.stateful:
            return None
        return {"epoch": epoch, "state": json.loads(json.dumps(self.source.state_dict()))}

    def restore(self, saved: dict[str, Any]) -> int:
        """Load a state(); returns its epoch (the next pass continues inside it)."""
        epoch = int(saved["epoch"])
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)
        self.source.load_state_dict(saved["state"])
        return epoch

    def first(self, count: int) -> list[Any]:
        """Up to `count` samples from the start of the stream (the checks before training)."""
        return list(islice(self.samples(0), count))


def json_state(source: Any) -> bool:
    """Whether `source` has a state_dict() / load_state_dict() pair whose state is JSON (it
    goes into the checkpoint's trainer.json)."""
    if not (callable(getattr(source, "state_dict", None))
            and callable(getattr(source, "load_state_dict", None))):
        return False
    try:
        json.dumps(source.state_dict())
    except (TypeError, ValueError):
        return False
    return True


class StreamBatches:
    """This rank's micro-batches of steps [start_step, start_step + num_steps) (forever
    when num_steps is None), from the global stream. `position`: a checkpoint's data
    position (its "samples" and the stream's "stream" state), used where it is of
    start_step; else the samples before start_step are read and skipped. The global batch
    of a step is read when its first micro-batch is asked for, so after a whole step
    `position()` is that of the step's end: what a checkpoint of it holds."""

    def __init__(
        self,
        stream: Stream,
        *,
        micro_batch: int,
        grad_accum: int,
        dp_rank: int,
        dp_size: int,
        start_step: int = 0,
        num_steps: int | None = None,
        position: dict[str, Any] | None = None,
    ):
        self.stream = stream
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.dp_rank = dp_rank
        self.global_batch = micro_batch * grad_accum * dp_size
        self.step = start_step
        self.stop = None if num_steps is None else start_step + num_steps
        self.consumed = start_step * self.global_batch
        self.epoch = 0
        self.resumed: str | None = None  # how the position was restored: said on resume
        self._queue: list[Batch] = []
        self._samples = self._walk(position)

    def __iter__(self) -> StreamBatches:
        return self

    def __next__(self) -> Batch:
        if not self._queue:
            if self.stop is not None and self.step >= self.stop:
                raise StopIteration
            self._queue = self._step_batches(list(islice(self._samples, self.global_batch)))
            self.step += 1
        return self._queue.pop(0)

    def position(self) -> dict[str, Any]:
        """Samples consumed, and the stream's own state where it resumes exactly."""
        return {"samples": self.consumed, "stream": self.stream.state(self.epoch)}

    def _step_batches(self, samples: list[Any]) -> list[Batch]:
        self.consumed += len(samples)
        first = self.dp_rank * self.grad_accum * self.micro_batch
        return [
            self.stream.batch_of(samples[first + a * self.micro_batch:][: self.micro_batch])
            for a in range(self.grad_accum)
        ]

    def _walk(self, position: dict[str, Any] | None) -> Iterator[Any]:
        """The samples from stream position `consumed` on, epoch after epoch."""
        skip, resumed_epoch = self.consumed, None
        saved = (position or {}).get("stream")
        if skip and saved and self.stream.stateful and position.get("samples") == skip:
            resumed_epoch = self.epoch = self.stream.restore(saved)
            self.resumed = f"restored at sample {skip} from the dataset's state_dict"
            skip = 0
        elif skip:
            self.resumed = f"read again from its start, skipping the {skip} samples trained on"
        return self._epochs(skip, resumed_epoch)

    def _epochs(self, skip: int, resumed_epoch: int | None) -> Iterator[Any]:
        while True:
            seen = 0
            for sample in self.stream.samples(self.epoch):
                seen += 1
                if skip:
                    skip -= 1
                    continue
                yield sample
            if not seen and self.epoch != resumed_epoch:
                raise DataError(
                    f"{self.stream.what} yielded no samples in its pass {self.epoch + 1}: an "
                    "iterable is read again for each epoch; make it start over when iterated"
                )
            self.epoch += 1


def stream_eval_batches(
    stream: Stream, *, micro_batch: int, max_batches: int, dp_rank: int, dp_size: int
) -> list[Batch]:
    """Held-out batches of a stream, from its start: what build_eval_loader gives a
    map-style split of the samples read (at most max_batches x micro_batch x dp of them):
    every rank the same number of distinct samples, smaller batches for a short split."""
    samples = stream.first(max_batches * micro_batch * dp_size)
    n = len(samples)
    mb = min(micro_batch, max(1, n // (dp_size * max_batches)))
    steps = max(1, min(max_batches, n // (dp_size * mb)))
    if n < dp_size:
        raise DataError(
            f"{stream.what}: its validation split has {n} samples, fewer than the {dp_size} "
            "data-parallel ranks that evaluate; give a longer split or set train.eval_every = 0"
        )
    return [
        stream.batch_of(samples[(s * dp_size + dp_rank) * mb:][:mb]) for s in range(steps)
    ]
