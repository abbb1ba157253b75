"""Your own dataset: `data.dataset = 'package.module:attr'`, the attribute a dataset or a
function (or class) returning one, called with no arguments.

Forms taken: a map-style torch Dataset (`__len__` and `__getitem__`; a list of samples
too), an iterable one (a torch IterableDataset, any object whose `__iter__` starts over),
a Hugging Face `datasets.Dataset` or streaming `IterableDataset` (read `.with_format(
'torch')` when it has no format), a function returning a generator (called again for each
pass), and splits: a dict with 'train' and 'validation' (or 'val'), as a `DatasetDict`
is, or a tuple (train, validation).

The held-out split: the one given; else, for a map-style dataset, its last
data.val_fraction of the samples (by index); an iterable without one is not evaluated.
Map-style data is shared out by ShardedBatchSampler, iterables by data/stream.py. The
checks before any worker (one collated micro-batch, one global batch's samples) are
`user_data_problems`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch.utils.data import Dataset, IterableDataset, Subset, default_collate

from trainwise.data.batch import BatchMaker
from trainwise.data.stream import Stream, json_state
from trainwise.errors import DataError
from trainwise.objects import first_line, load_callable, load_object

VAL_SPLITS = ("validation", "val")
DATASET_WHAT = "a dataset or a function returning one"


class MapData(Dataset):
    """A map-style dataset of yours with the collate its loader uses (`batch_of`)."""

    def __init__(self, inner: Any, batch_of: Callable[[list[Any]], Any], what: str):
        self.inner, self.batch_of, self.what = inner, batch_of, what

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        return self.inner[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        # A Hugging Face dataset reads a batch of rows at once; others one by one.
        many = getattr(self.inner, "__getitems__", None)
        return list(many(indices)) if many else [self.inner[i] for i in indices]


def _hf(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "datasets"


def _is_dataset(obj: Any) -> bool:
    """A dataset object (not a class, not a function that makes one)."""
    if isinstance(obj, type):
        return False
    return isinstance(obj, Dataset) or hasattr(obj, "__iter__") or hasattr(obj, "__getitem__")


def _split_like(obj: Any) -> bool:
    """What may be one half of a (train, validation) tuple: not a sample's tensor."""
    return isinstance(obj, (Dataset, list)) or _hf(obj)


def _torch_format(obj: Any) -> Any:
    """A Hugging Face dataset without a format yields Python lists, which default_collate
    batches per position: read it as torch tensors instead."""
    if not _hf(obj) or not hasattr(obj, "with_format"):
        return obj
    unformatted = (
        obj.format.get("type") is None if isinstance(getattr(obj, "format", None), dict)
        else getattr(obj, "_formatting", None) is None
    )
    return obj.with_format("torch") if unformatted else obj


def _shuffle_buffer(obj: Any) -> bool:
    """Whether a Hugging Face IterableDataset shuffles in a buffer (its state_dict does
    not hold the buffer: Hugging Face refills it on load, so the resumed order differs)."""
    todo, seen = [getattr(obj, "_ex_iterable", None)], 0
    while todo and seen < 100:
        node, seen = todo.pop(), seen + 1
        if node is None:
            continue
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return True
        todo += [getattr(node, "ex_iterable", None), *getattr(node, "ex_iterables", [])]
    return False


class UserData:
    """Your dataset, resolved: `train` and `val` (MapData, Stream or None) and the lines the
    launcher says about them before training (`notes`)."""

    def __init__(
        self, path: str, collate: str | None, val_fraction: float, num_workers: int = 0
    ):
        self.path = path
        self.what = f"data.dataset = {path!r}"
        self.notes: list[str] = []
        self.batch_of = _batch_maker(path, collate)
        obj, factory = _resolve(path)
        train, val = _splits(obj, self.what)
        self.train = self._source(train, factory if train is obj else None, self.what)
        if val is not None:
            self.val = self._source(val, None, f"{self.what} (its validation split)")
        elif isinstance(self.train, MapData):
            self.train, self.val = _hold_out(self.train, val_fraction, self.what)
        else:
            self.val = None
            self.notes.append(
                f"{self.what} is an iterable without a validation split: no evaluation "
                "(give a dict with 'validation' or a tuple (train, validation) to evaluate)"
            )
        if isinstance(self.train, Stream) and num_workers:
            self.notes.append(
                f"data.num_workers = {num_workers} does not apply to {self.what}: an iterable "
                "is read in each rank's own process"
            )

    def _source(self, obj: Any, factory: Callable[[], Any] | None, what: str) -> Any:
        obj = _torch_format(obj)
        if isinstance(obj, (str, bytes)):
            raise DataError(
                f"{what} is a {type(obj).__name__}, not {DATASET_WHAT}: point it at a torch "
                "Dataset, a Hugging Face dataset or a function returning one"
            )
        if isinstance(obj, IterableDataset) or (
            hasattr(obj, "__iter__") and not hasattr(obj, "__len__")
        ):
            return self._stream(obj, factory, what)
        if hasattr(obj, "__len__") and hasattr(obj, "__getitem__"):
            return MapData(obj, self.batch_of, what)
        if isinstance(obj, Dataset):
            raise DataError(
                f"{what} is a map-style {type(obj).__name__} without __len__: give it "
                "__len__, or make it an IterableDataset"
            )
        raise DataError(
            f"{what} is a {type(obj).__name__}, not {DATASET_WHAT}: give it __len__ and "
            "__getitem__ (map-style) or __iter__ (iterable)"
        )

    def _stream(self, obj: Any, factory: Callable[[], Any] | None, what: str) -> Stream:
        if iter(obj) is obj:  # a generator: read once
            if factory is None:
                raise DataError(
                    f"{what} is a {type(obj).__name__}, an iterator read only once, but the "
                    "checks, each worker and a resume read the data from its start: name a "
                    "function that returns it (called again for each pass) or an IterableDataset"
                )
            self.notes.append(
                f"{what} returns a {type(obj).__name__}: each pass calls it again; a resume "
                "reads it from its start and skips the samples trained on (exact if it "
                "yields the same samples each time)"
            )
            return Stream(what, self.batch_of, factory=factory)
        if what != self.what:  # a validation split: read from its start each time
            return Stream(what, self.batch_of, source=obj)
        stateful = json_state(obj)
        if stateful and _hf(obj) and _shuffle_buffer(obj):
            stateful = False
            self.notes.append(
                f"{what} shuffles in a buffer, which its state_dict does not hold: a resume "
                "reads the stream again from its start and skips the samples trained on "
                "(exact only when the shuffle has a seed: .shuffle(seed=...))"
            )
        elif stateful:
            self.notes.append(
                f"{what} is an iterable: every rank reads the whole stream and keeps its share "
                "of each global batch; a resume restores its position from its state_dict"
            )
        else:
            self.notes.append(
                f"{what} is an iterable without a state_dict: a resume reads it again from "
                "its start and skips the samples trained on (exact if it yields the same "
                "samples each time it is read)"
            )
        return Stream(what, self.batch_of, source=obj, stateful=stateful)


def _batch_maker(path: str, collate: str | None) -> BatchMaker:
    if collate is None:
        where = f"data.dataset = {path!r} (batched by torch's default_collate)"
        return BatchMaker(default_collate, where, own=False)
    fn = load_callable(collate, "data.collate", DataError, "a function (list of samples) -> batch")
    return BatchMaker(fn, f"data.collate = {collate!r}")


def _resolve(path: str) -> tuple[Any, Callable[[], Any] | None]:
    """The object data.dataset names, called when it is a function or a class: (the
    dataset, the function that made it or None)."""
    obj = load_object(path, "data.dataset", DataError, DATASET_WHAT)
    if _is_dataset(obj) or not callable(obj):
        return obj, None
    try:
        return obj(), obj
    except Exception as exc:  # the user's code failed: one line, not a traceback
        raise DataError(
            f"data.dataset = {path!r}: calling it raised {first_line(exc)}; fix the function "
            "(it is called with no arguments)"
        ) from exc


def _splits(obj: Any, what: str) -> tuple[Any, Any]:
    """(train, validation or None) of a dict of splits, a (train, validation) tuple, or
    one dataset."""
    if isinstance(obj, Mapping):
        if "train" not in obj:
            raise DataError(
                f"{what} is a dict of splits {sorted(obj)} without 'train': name the training "
                "split 'train' (and the held-out one 'validation')"
            )
        return obj["train"], next((obj[k] for k in VAL_SPLITS if k in obj), None)
    if isinstance(obj, tuple) and len(obj) == 2 and all(_split_like(o) for o in obj):
        return obj[0], obj[1]
    return obj, None


def _hold_out(data: MapData, fraction: float, what: str) -> tuple[MapData, MapData]:
    """(train, validation): the last `fraction` of the samples, by index, held out."""
    n = len(data)
    n_val = int(round(n * fraction))
    if not 0 < n_val < n:
        raise DataError(
            f"{what} has {n} samples: data.val_fraction = {fraction} leaves an empty split; "
            "use more samples, a val_fraction nearer 0.5, or give a validation split"
        )
    inner = data.inner
    train = MapData(Subset(inner, range(n - n_val)), data.batch_of, what)
    val = MapData(Subset(inner, range(n - n_val, n)), data.batch_of, f"{what} (held out)")
    return train, val


def user_data_problems(
    train: Any, val: Any, *, micro_batch: int, grad_accum: int, dp: int, evaluate: bool
) -> list[str]:
    """Before any worker: one global batch of training samples exists and one micro-batch
    of them collates into the step's tensors; likewise the validation split, when the run
    evaluates. One line each, naming the dataset (or data.collate) and the fix."""
    g = micro_batch * grad_accum * dp
    problems = _split_problems(train, micro_batch, g, (
        f"one global batch of {g} (data.micro_batch {micro_batch} x data.grad_accum "
        f"{grad_accum} x data-parallel size {dp}): lower data.micro_batch or use more data"
    ))
    if evaluate and val is not None and not problems:  # one cause, one line
        problems += _split_problems(val, micro_batch, dp, (
            f"the {dp} data-parallel ranks that evaluate: give a longer validation split or "
            "set train.eval_every = 0"
        ))
    return problems


def _split_problems(data: Any, micro_batch: int, need: int, fewer_than: str) -> list[str]:
    what = data.what
    try:
        if isinstance(data, Stream):
            samples = data.first(need)
            n = len(samples)
        else:
            n = len(data)
            samples = data.__getitems__(list(range(min(n, micro_batch))))
    except Exception as exc:  # the user's code failed: one line, not a traceback
        return [f"{what}: reading its first samples raised {first_line(exc)}; fix the dataset"]
    if n < need:
        counted = f"{n} samples" if not isinstance(data, Stream) else f"only {n} samples"
        return [f"{what} has {counted}, fewer than {fewer_than}"]
    maker, sample = data.batch_of, samples[0]
    if not maker.own and (sample is None or isinstance(sample, (str, bytes, int, float))):
        return [
            f"{what} yields {type(sample).__name__} samples; the step needs tensors (inputs, "
            "target): return a tuple (inputs, target) or a dict with 'labels', or give "
            "data.collate that makes them"
        ]
    try:
        maker(samples[:micro_batch])
    except DataError as err:
        return err.problems
    except Exception as exc:  # the collate failed on the dataset's samples
        if maker.own:
            return [
                f"{maker.where}: batching {min(n, micro_batch)} samples of {what} raised "
                f"{first_line(exc)}; fix the function"
            ]
        return [
            f"{what}: torch's default_collate cannot batch its samples ({first_line(exc)}); "
            "return tensors of one shape, or give data.collate that batches them"
        ]
    return []


def first_batch(dataset: Any, size: int) -> Any:
    """The first `size` samples of a training set as the step takes them (your collate for
    your own dataset, torch's default_collate for a built-in one): the sample batch the
    planner measures a module on."""
    if isinstance(dataset, Stream):
        return dataset.batch_of(dataset.first(size))
    samples = [dataset[i] for i in range(min(size, len(dataset)))]
    return getattr(dataset, "batch_of", default_collate)(samples)
