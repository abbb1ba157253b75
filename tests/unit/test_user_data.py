"""Your own dataset (data/user.py, data/batch.py, data/stream.py) without processes: the
forms data.dataset takes and their splits, how a collated batch becomes the step's
(inputs, target, ...), how every rank shares an iterable and resumes it, and the checks
before any worker (typed errors from Python, one line each naming the object)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset

import user_job
from trainwise.config import load_config
from trainwise.data import build_datasets, build_eval_loader, build_loader, user_data_problems
from trainwise.data.batch import as_batch
from trainwise.data.stream import Stream, StreamBatches, stream_eval_batches
from trainwise.data.user import MapData, UserData
from trainwise.errors import ConfigError, DataError, ModelError
from trainwise.hardware import GB, DeviceInfo
from trainwise.models.registry import ModelSpec, build_model
from trainwise.run.job.resolve import prepare_job, start_lines

CPU = DeviceInfo("cpu", "cpu", 1, 64 * GB, bf16=True, fp16=False, gpu=None)

FORMS = '''
import torch
from torch.utils.data import Dataset, IterableDataset
import user_job

def samples(n=40):
    return [(torch.tensor([float(i)]), torch.tensor(i % 2)) for i in range(n)]

pair = (samples(40), samples(8))
tiny_val = (samples(40), samples(1))
a_list = samples(40)
class Rows(Dataset):
    def __len__(self): return 40
    def __getitem__(self, i): return samples(40)[i]
def gen():
    return (s for s in samples(40))
a_generator = (s for s in samples(40))
a_number = 3
a_text = "rows.jsonl"
no_train = {"validation": samples(8)}
class NoLen(Dataset):
    def __getitem__(self, i): return samples(40)[i]
no_len = NoLen()
class Counting(IterableDataset):
    def __iter__(self): return iter(samples(40))
counting = Counting()
def broken_collate(batch): raise ValueError("no batch today")
'''


@pytest.fixture
def forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of dataset objects in the forms data.dataset takes (and some it refuses)."""
    (tmp_path / "tw_own_forms.py").write_text(textwrap.dedent(FORMS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tw_own_forms"


@pytest.fixture
def jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """user_job's JSONL files, where its Hugging Face datasets read them."""
    folder = user_job.write_jsonl(tmp_path / "data")
    monkeypatch.setenv(user_job.DIR_ENV, str(folder))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return folder


def built(path: str, **options):
    return build_datasets(path, seq_len=1, val_fraction=0.1, seed=0, **options)


def ids(batches) -> list[int]:
    """The ids of a list of counted batches (their third tensor)."""
    return [int(i) for b in batches for i in b[2]]


# --- the forms and their splits ----------------------------------------------------------


def test_a_map_style_dataset_holds_out_its_last_val_fraction(jsonl: Path):
    train, val, info = built("user_job:map_counted")
    assert isinstance(train, MapData) and (info.train_samples, info.val_samples) == (461, 51)
    assert info.task == "custom" and info.notes == ()
    assert [int(val[i][2]) for i in range(len(val))] == list(range(461, 512))


def test_a_hugging_face_dataset_dict_evaluates_on_its_validation_split(jsonl: Path):
    train, val, info = built("user_job:hf_data")
    assert (info.train_samples, info.val_samples) == (512, 64)  # val_fraction not applied
    x, y = train.batch_of([train[0], train[1]])  # read as torch tensors
    assert x.shape == (2, user_job.FEATURES) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(x[1], torch.tensor(user_job.features(1)))


def test_a_stream_is_read_as_a_stream_and_says_how_it_resumes(jsonl: Path):
    train, val, info = built("user_job:hf_stream")
    assert isinstance(train, Stream) and isinstance(val, Stream) and train.stateful
    assert info.train_samples is None and info.val_samples is None
    assert len(info.notes) == 1 and "restores its position from its state_dict" in info.notes[0]


def test_a_stream_without_a_validation_split_is_not_evaluated_said_once(jsonl: Path):
    train, val, info = built("user_job:hf_stream_counted", num_workers=2)
    assert val is None
    assert sum("no evaluation" in n for n in info.notes) == 1
    assert any("data.num_workers = 2 does not apply" in n for n in info.notes)


@pytest.mark.parametrize(
    ("attr", "kind", "train", "val"),
    [("pair", MapData, 40, 8), ("a_list", MapData, 36, 4), ("Rows", MapData, 36, 4),
     ("counting", Stream, None, None), ("gen", Stream, None, None)],
)
def test_the_forms_taken(forms: str, attr, kind, train, val):
    tr, va, info = built(f"{forms}:{attr}")
    assert isinstance(tr, kind) and (info.train_samples, info.val_samples) == (train, val)
    first = build_loader(tr, micro_batch=4, grad_accum=1, dp_rank=0, dp_size=1, seed=0,
                         num_steps=1, shuffle=False)
    assert [b[0].shape for b in first] == [(4, 1)]


def test_a_function_returning_a_generator_is_called_again_for_each_pass(forms: str):
    train, _, info = built(f"{forms}:gen")
    assert train.first(3) == train.first(3)
    assert any("each pass calls it again" in n for n in info.notes)


@pytest.mark.parametrize(
    ("attr", "words"),
    [
        ("a_generator", "an iterator read only once"),
        ("a_number", "is a int, not a dataset or a function returning one"),
        ("a_text", "is a str, not a dataset"),
        ("no_train", "without 'train'"),
        ("no_len", "without __len__"),
        ("nothing_here", "has no attribute 'nothing_here'"),
    ],
)
def test_what_is_not_a_dataset_is_one_line_naming_it(forms: str, attr: str, words: str):
    with pytest.raises(DataError) as err:
        built(f"{forms}:{attr}")
    (line,) = err.value.problems
    assert line.startswith(f"data.dataset = '{forms}:{attr}'") and words in line


def test_a_factory_that_raises_is_one_line_with_its_error():
    with pytest.raises(DataError) as err:
        built("user_job:raises")
    assert err.value.problems == [
        "data.dataset = 'user_job:raises': calling it raised RuntimeError: the bucket is not "
        "mounted; fix the function (it is called with no arguments)"
    ]


# --- the step's batch --------------------------------------------------------------------


def test_a_dict_batch_maps_to_inputs_in_order_then_the_target():
    a, m, y = torch.ones(2, 3), torch.zeros(2, 3), torch.tensor([1, 0])
    batch = as_batch({"input_ids": a, "text": ["x", "y"], "labels": y, "attention_mask": m}, "w")
    assert batch[0] is a and batch[1] is y and batch[2] is m and len(batch) == 3
    assert as_batch((a, y), "w") == (a, y)


@pytest.mark.parametrize(
    ("collated", "words"),
    [
        ({"x": torch.ones(2), "y": torch.ones(2)}, "none of 'labels', 'label', 'target'"),
        ({"x": torch.ones(2), "label": torch.ones(2), "labels": torch.ones(2)}, "2 of"),
        ({"x": [1.0, 2.0], "labels": [0, 1]}, "whose 'labels' is a list"),
        ((torch.ones(2), [0, 1]), "(tensor[2], list)"),
        (torch.ones(2, 3), "batches of type tensor[2, 3]"),
    ],
)
def test_a_batch_the_step_cannot_take_is_one_line(collated, words):
    with pytest.raises(DataError) as err:
        as_batch(collated, "data.collate = 'm:f'")
    (line,) = err.value.problems
    assert line.startswith("data.collate = 'm:f' makes") and words in line


# --- every rank's share of a stream, and its position --------------------------------------


class Numbers(IterableDataset):
    """0..n-1, the same each pass; no state_dict (resumed by replay)."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def number_batch(samples: list) -> tuple[torch.Tensor, ...]:
    t = torch.tensor([int(s["i"]) if isinstance(s, dict) else int(s) for s in samples])
    return (t, t, t)


def hf_numbers(n: int, **shuffle):
    import datasets

    ds = datasets.Dataset.from_dict({"i": list(range(n))}).to_iterable_dataset(num_shards=3)
    return ds.shuffle(**shuffle) if shuffle else ds


def stream_of(source) -> Stream:
    from trainwise.data.stream import json_state

    return Stream("data.dataset = 't:s'", number_batch, source=source, stateful=json_state(source))


def rank_batches(source, dp: int, steps: int, accum: int = 2, **kw) -> list[list[int]]:
    """Per rank, the ids of its micro-batches over `steps` steps (micro-batch 2)."""
    return [
        ids(StreamBatches(stream_of(source()), micro_batch=2, grad_accum=accum, dp_rank=r,
                          dp_size=dp, num_steps=steps, **kw))
        for r in range(dp)
    ]


@pytest.mark.parametrize("source", [lambda: Numbers(37), lambda: hf_numbers(37)])
def test_a_steps_samples_are_the_same_whatever_the_number_of_ranks(source):
    steps, g = 7, 16  # 7 x 16 samples of a 37-sample stream: three passes
    unions = []
    for dp in (1, 2, 4):
        shares = rank_batches(source, dp, steps, accum=8 // dp)  # micro-batch 2
        unions.append([
            i for s in range(steps) for r in range(dp)
            for i in shares[r][s * g // dp:(s + 1) * g // dp]
        ])
    assert unions[0] == unions[1] == unions[2]
    # Pass after pass (a Hugging Face stream reorders its shards in a new epoch).
    passes = [sorted(unions[0][k:k + 37]) for k in (0, 37, 74)]
    assert unions[0][:37] == list(range(37)) and passes[1] == passes[2] == list(range(37))


@pytest.mark.parametrize(
    ("source", "stateful", "how"),
    [(lambda: hf_numbers(37), True, "from the dataset's state_dict"),
     (lambda: Numbers(37), False, "skipping the 48 samples trained on"),
     # HF's state_dict does not hold a shuffle buffer: a seeded one is replayed exactly.
     (lambda: hf_numbers(37, seed=3, buffer_size=8), False, "skipping the 48 samples")],
)
def test_a_stream_resumes_at_its_position_exactly(source, stateful, how):
    def stream() -> Stream:
        return Stream("data.dataset = 't:s'", number_batch, source=source(), stateful=stateful)

    whole = StreamBatches(stream(), micro_batch=4, grad_accum=1, dp_rank=1, dp_size=4,
                          num_steps=8)
    first = [next(whole) for _ in range(3)]  # 3 steps: 48 samples, into the second pass
    saved = json.loads(json.dumps(whole.position()))  # as trainer.json holds it
    assert saved["samples"] == 48 and (saved["stream"] is not None) == stateful
    rest = list(whole)
    resumed = StreamBatches(stream(), micro_batch=4, grad_accum=1, dp_rank=1, dp_size=4,
                            start_step=3, num_steps=5, position=saved)
    assert how in resumed.resumed
    again = list(resumed)
    assert [b[0].tolist() for b in again] == [b[0].tolist() for b in rest]
    assert len(first) == 3 and len(again) == 5


def test_a_shuffle_buffer_is_resumed_by_replay_said_at_start(monkeypatch, tmp_path: Path):
    (tmp_path / "tw_shuffled.py").write_text(textwrap.dedent('''
        import datasets
        def data():
            ds = datasets.Dataset.from_dict({"i": list(range(40))}).to_iterable_dataset(4)
            return ds.shuffle(seed=1, buffer_size=8)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    user = UserData("tw_shuffled:data", "test_user_data:number_batch", 0.1)
    assert not user.train.stateful
    assert any("shuffles in a buffer" in n and ".shuffle(seed=...)" in n for n in user.notes)


def test_an_iterable_that_yields_nothing_on_a_pass_stops_with_one_line():
    loader = StreamBatches(stream_of(Numbers(0)), micro_batch=2, grad_accum=1, dp_rank=0,
                           dp_size=1, num_steps=1)
    with pytest.raises(DataError, match="yielded no samples in its pass 1"):
        next(loader)


def test_a_streams_evaluation_is_the_map_style_rule():
    from trainwise.data.user import MapData

    for n, dp in ((40, 2), (11, 2), (5, 4)):
        mapped = MapData(list(range(n)), number_batch, "m")
        for rank in range(dp):
            kw = dict(micro_batch=4, max_batches=3, dp_rank=rank, dp_size=dp)
            want = [b[0].tolist() for b in build_eval_loader(mapped, seed=0, **kw)]
            got = [b[0].tolist() for b in stream_eval_batches(stream_of(Numbers(n)), **kw)]
            assert got == want, (n, dp, rank)


# --- checks before any worker ------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "words"),
    [
        (["data.dataset=user_job:strings"],
         "data.dataset = 'user_job:strings' yields str samples; the step needs tensors"),
        (["data.dataset=user_job:map_data", "data.collate=user_job:no_tensors"],
         "data.collate = 'user_job:no_tensors' makes dict batches with keys ['labels', 'x'] "
         "whose 'labels' is a list"),
        (["data.dataset=user_job:too_short", "data.val_fraction=0.2"],
         "data.dataset = 'user_job:too_short' has 8 samples, fewer than one global batch of "
         "16 (data.micro_batch 8 x data.grad_accum 1 x data-parallel size 2)"),
        (["data.dataset=user_job:too_short"],
         "data.dataset = 'user_job:too_short' has 10 samples: data.val_fraction = 0.05 "
         "leaves an empty split"),
        (["data.dataset=tw_own_forms:tiny_val"],
         "data.dataset = 'tw_own_forms:tiny_val' (its validation split) has 1 samples, fewer "
         "than the 2 data-parallel ranks that evaluate"),
        (["data.dataset=user_job:raises"], "calling it raised RuntimeError"),
        (["data.dataset=tw_own_forms:a_list", "data.collate=tw_own_forms:broken_collate"],
         "data.collate = 'tw_own_forms:broken_collate': batching 8 samples of data.dataset = "
         "'tw_own_forms:a_list' raised ValueError: no batch today; fix the function"),
        (["data.dataset=user_job:map_data", "model.loss=user_job:no_such_loss"],
         "model.loss = 'user_job:no_such_loss': module 'user_job' has no attribute"),
    ],
)
def test_bad_input_is_a_typed_error_from_python_naming_the_object(forms, keys, words):
    cfg = load_config(overrides=["model.name=user_job:build", "data.micro_batch=8",
                                 "parallel.strategy=ddp", *keys])
    with pytest.raises(ConfigError) as err:
        prepare_job(cfg, 2, CPU)
    assert len(err.value.problems) == 1 and words in err.value.problems[0], err.value.problems


def test_a_stream_shorter_than_one_global_batch_is_refused(forms: str):
    user = UserData(f"{forms}:counting", None, 0.1)
    (line,) = user_data_problems(user.train, None, micro_batch=16, grad_accum=2, dp=2,
                                 evaluate=True)
    assert line.startswith(f"data.dataset = '{forms}:counting' has only 40 samples, fewer "
                           "than one global batch of 64")


def test_a_good_job_says_its_data_notes_before_the_workers(jsonl: Path):
    cfg = load_config(overrides=["model.name=user_job:build", "data.dataset=user_job:hf_stream",
                                 "data.micro_batch=8", "parallel.strategy=ddp"])
    job = prepare_job(cfg, 2, CPU)
    assert job.data.task == "custom" and job.global_batch == 16
    lines = start_lines(job, 2, 2)
    assert any("trainwise: data.dataset = 'user_job:hf_stream' is an iterable" in ln
               for ln in lines)


# --- model.loss --------------------------------------------------------------------------


def halved(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output, target) / 2


def test_model_loss_takes_the_place_of_the_models_own():
    x, y = torch.randn(4, user_job.FEATURES), torch.tensor([0, 1, 2, 3])
    own = build_model(ModelSpec("user_job:build"))
    named = build_model(ModelSpec("user_job:build", loss="test_user_data:halved"))
    out = own.module(x)
    assert named.loss_fn(out, y) == own.loss_fn(out, y) / 2
    with pytest.raises(ModelError, match="model.loss = 'user_job:FEATURES'"):
        build_model(ModelSpec("user_job:build", loss="user_job:FEATURES"))
