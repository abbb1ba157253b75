"""Unit tests of trainwise.config: defaults, precedence (defaults < file < flags < --set),
--set value parsing, one-line problems for every kind of bad input, the consistency rules
and the dump_toml round trip."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

from trainwise.config import (
    JobConfig,
    Strategy,
    check_consistency,
    dump_toml,
    load_config,
    parse_value,
)
from trainwise.config.schema import OptimConfig
from trainwise.errors import ConfigError


def _problems(**kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    return info.value.problems


def _write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- defaults and precedence -------------------------------------------------------------


def test_defaults_load_and_are_valid():
    cfg = load_config()
    assert cfg == JobConfig()
    assert check_consistency(cfg) == []
    # The documented defaults of a few keys (schema.py).
    assert cfg.model.name == "tiny"
    assert cfg.optim.lr == 3e-3
    assert cfg.parallel.strategy == "auto"
    assert cfg.data.global_batch is None


def test_precedence_file_then_flag_then_set(tmp_path):
    path = _write(tmp_path, "[optim]\nlr = 0.1\n\n[train]\nsteps = 7\n")
    assert load_config(path).optim.lr == 0.1
    # A flag of None means "not given": the file's value stays.
    assert load_config(path, flags={"optim.lr": None}).optim.lr == 0.1
    assert load_config(path, flags={"optim.lr": 0.2}).optim.lr == 0.2
    cfg = load_config(path, flags={"optim.lr": 0.2}, overrides=["optim.lr=0.3"])
    assert cfg.optim.lr == 0.3
    # Keys that nothing overrides keep the file's value, others the defaults.
    assert cfg.train.steps == 7
    assert cfg.train.seed == JobConfig().train.seed


def test_set_overrides_only_its_key_in_a_file_section(tmp_path):
    path = _write(tmp_path, "[optim]\nlr = 0.1\nweight_decay = 0.5\n")
    cfg = load_config(path, overrides=["optim.lr=0.3"])
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (0.3, 0.5)


# --- --set values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3", 3),
        ("-2", -2),
        ("3e-4", 3e-4),
        ("0.5", 0.5),
        ("true", True),
        ("false", False),
        ("[1, 2, 3]", [1, 2, 3]),
        ('{a = 1, b = "x"}', {"a": 1, "b": "x"}),
        ('"quoted words"', "quoted words"),
        ("tiny", "tiny"),  # a bare word is not TOML: it stays a string
        ("pkg.mod:factory", "pkg.mod:factory"),
    ],
)
def test_parse_value(text, expected):
    value = parse_value(text)
    assert value == expected
    assert type(value) is type(expected)


def test_set_values_are_parsed_as_toml():
    cfg = load_config(
        overrides=[
            "data.seq_len=32",
            "optim.lr=5e-4",
            "train.compile=true",
            "model.hidden=[8, 4]",
            'model.kwargs={width = 8, act = "relu", inner = {depth = 2}}',
            "model.name=small",
            "logging.progress = none",  # spaces around '=' are allowed
        ]
    )
    assert cfg.data.seq_len == 32
    assert cfg.optim.lr == 5e-4
    assert cfg.train.compile is True
    assert cfg.model.hidden == [8, 4]
    assert cfg.model.kwargs == {"width": 8, "act": "relu", "inner": {"depth": 2}}
    assert cfg.model.name == "small"
    assert cfg.logging.progress == "none"


@pytest.mark.parametrize("item", ["noequals", "=3"])
def test_malformed_set_is_an_error(item):
    problems = _problems(overrides=[item])
    assert len(problems) == 1
    assert repr(item) in problems[0]
    assert "key=value" in problems[0]


# --- unknown keys and bad values -------------------------------------------------------------


def test_unknown_key_in_file_names_key_source_and_allowed_keys(tmp_path):
    path = _write(tmp_path, "[optim]\nlrr = 0.1\n")
    problems = _problems(path=path)
    assert len(problems) == 1
    msg = problems[0]
    assert "'optim.lrr'" in msg
    assert str(path) in msg
    assert "[optim]" in msg
    for key in ("name", "lr", "weight_decay", "betas", "eps", "momentum"):  # schema.py
        assert key in msg
    assert set(OptimConfig.model_fields) == {
        "name",
        "lr",
        "weight_decay",
        "betas",
        "eps",
        "momentum",
        "implementation",
    }


def test_unknown_key_in_set_names_set_as_source():
    problems = _problems(overrides=["optim.lrr=0.1"])
    assert len(problems) == 1
    assert "'optim.lrr'" in problems[0]
    assert "--set" in problems[0]
    assert "weight_decay" in problems[0]


def test_unknown_section():
    problems = _problems(overrides=["foo.bar=1"])
    assert len(problems) == 1
    msg = problems[0]
    assert "'foo'" in msg
    assert "--set" in msg
    assert "top level" in msg
    for section in ("model", "data", "optim", "parallel", "logging"):
        assert section in msg


def test_bad_literal_lists_the_allowed_values():
    problems = _problems(overrides=["parallel.strategy=fdsp"])
    assert len(problems) == 1
    msg = problems[0]
    assert "parallel.strategy" in msg
    assert "'fdsp'" in msg
    assert "--set" in msg
    allowed = get_args(Strategy)
    assert len(allowed) == 8  # train's five and the planner's three row names
    for value in allowed:
        assert f"'{value}'" in msg


def test_a_job_flag_is_named_as_typed_with_the_accepted_values():
    from trainwise.cli.train import JOB_FLAGS

    problems = _problems(flags={"precision.dtype": "fp8"}, flag_names=JOB_FLAGS)
    assert len(problems) == 1
    assert "(from --precision)" in problems[0] and "--dtype" not in problems[0]
    for value in ("fp32", "bf16", "fp16"):
        assert f"'{value}'" in problems[0]


def test_flag_source_is_named_after_the_flag():
    problems = _problems(flags={"optim.lr": -1.0})
    assert len(problems) == 1
    assert "optim.lr" in problems[0]
    assert "--lr" in problems[0]


def test_bad_value_in_file_names_the_file(tmp_path):
    path = _write(tmp_path, "[data]\nseq_len = 0\n")
    problems = _problems(path=path)
    assert len(problems) == 1
    assert "data.seq_len" in problems[0]
    assert str(path) in problems[0]


def test_several_problems_are_all_collected(tmp_path):
    path = _write(tmp_path, "[optim]\nlrr = 0.1\n")
    bad = ["optim.lr=-1", "data.seq_len=0", "parallel.ac=sometimes"]
    problems = _problems(path=path, overrides=bad)
    # Three bad values from --set plus one unknown key from the file.
    assert len(problems) == len(bad) + 1
    for key in ("optim.lr", "data.seq_len", "parallel.ac", "optim.lrr"):
        assert sum(key in p for p in problems) >= 1


def test_toml_syntax_error_names_file_and_line(tmp_path):
    path = _write(tmp_path, "[optim]\nlr = 0.1\nweight_decay = \n")  # line 3 has no value
    problems = _problems(path=path)
    assert len(problems) == 1
    assert problems[0].startswith(f"{path}:3:")
    assert "TOML syntax error" in problems[0]


def test_missing_config_file(tmp_path):
    path = tmp_path / "absent.toml"
    problems = _problems(path=path)
    assert len(problems) == 1
    assert str(path) in problems[0]
    assert "not found" in problems[0]


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
    problems = _problems(path=tmp_path)
    assert len(problems) == 1
    assert str(tmp_path) in problems[0] and "is a directory" in problems[0]
    assert "TOML" in problems[0] and "not found" not in problems[0]


@pytest.mark.parametrize(
    ("item", "phrase"),
    [
        ("train.steps=1e23", "beyond any real job"),
        ("train.steps=1e15", "more steps than any real run"),
        ("train.steps=2.5", "whole number"),
        ("train.steps=true", "whole number"),
        ("data.micro_batch=1e17", "beyond any real job"),
        ("cluster.nproc=1.5", "whole number"),
    ],
)
def test_absurd_or_fractional_counts_are_rejected(item, phrase):
    key, _, value = item.partition("=")
    problems = _problems(overrides=[item])
    assert len(problems) == 1
    assert problems[0].startswith(f"{key} = ") and "(from --set)" in problems[0]
    assert phrase in problems[0]


def test_several_bad_counts_are_all_collected():
    problems = _problems(overrides=["train.steps=1e23", "data.seq_len=0.5", "optim.lr=-1"])
    assert [p.split(" = ")[0] for p in problems] == ["data.seq_len", "train.steps", "optim.lr"]


def test_whole_floats_are_whole_numbers():
    cfg = load_config(overrides=["train.steps=1e3", "plan.params=7e9"])
    assert (cfg.train.steps, cfg.plan.params) == (1000, 7_000_000_000)
    assert isinstance(cfg.train.steps, int)


def test_every_problem_is_one_line(tmp_path):
    broken = _write(tmp_path, "[optim\nlr = 1\n", name="broken.toml")
    cases = [
        {"overrides": ["noequals"]},
        {"overrides": ["optim.lrr=1", "foo.bar=1", "parallel.strategy=fdsp"]},
        {"overrides": ["data.dataset=tokens", "checkpoint.interval=0"]},
        {"overrides": ['model.kwargs="not a table"', "optim.betas=[1]"]},
        {"path": broken},
        {"path": tmp_path / "absent.toml"},
    ]
    seen = 0
    for kwargs in cases:
        with pytest.raises(ConfigError) as info:
            load_config(**kwargs)
        for problem in info.value.problems:
            assert problem.strip()
            assert "\n" not in problem, problem
            seen += 1
        assert str(info.value) == "\n".join(info.value.problems)
    assert seen >= len(cases)


# --- consistency rules ----------------------------------------------------------------------

RULES = [
    # (bad settings, a phrase of the problem, settings that fix it)
    (
        {"data": {"dataset": "tokens"}},
        "data.path",
        {"data": {"dataset": "tokens", "path": "t.bin"}},
    ),
    (
        {"model": {"name": "mlp"}},
        "model.name = 'mlp'",
        {"model": {"name": "mlp"}, "data": {"dataset": "digits"}},
    ),
    (
        {"data": {"dataset": "digits"}},
        "data.dataset = 'digits'",
        {"data": {"dataset": "digits"}, "model": {"name": "pkg.mod:factory"}},
    ),
    (
        {"parallel": {"cpu_offload": True, "strategy": "ddp"}},
        "parallel.cpu_offload",
        {"parallel": {"cpu_offload": True, "strategy": "fsdp"}},
    ),
    (
        {"parallel": {"replicate": 2, "strategy": "fsdp"}},
        "parallel.replicate",
        {"parallel": {"replicate": 2, "strategy": "hsdp"}},
    ),
    (
        {"train": {"nonfinite": "rollback"}, "checkpoint": {"enabled": False}},
        "train.nonfinite",
        {"train": {"nonfinite": "rollback"}, "checkpoint": {"enabled": True}},
    ),
]


@pytest.mark.parametrize(("bad", "phrase", "ok"), RULES)
def test_consistency_rule(bad, phrase, ok):
    problems = check_consistency(JobConfig.model_validate(bad))
    assert len(problems) == 1
    assert phrase in problems[0]
    assert "\n" not in problems[0]
    assert check_consistency(JobConfig.model_validate(ok)) == []


@pytest.mark.parametrize(("bad", "phrase", "ok"), RULES)
def test_load_config_raises_consistency_problems(bad, phrase, ok):
    overrides = [
        f"{section}.{key}={str(value).lower() if isinstance(value, bool) else value}"
        for section, keys in bad.items()
        for key, value in keys.items()
    ]
    problems = _problems(overrides=overrides)
    assert len(problems) == 1
    assert phrase in problems[0]


def test_cpu_offload_is_for_sharded_strategies_chosen_by_hand():
    for strategy in ("fsdp", "hsdp"):
        cfg = JobConfig.model_validate({"parallel": {"cpu_offload": True, "strategy": strategy}})
        assert check_consistency(cfg) == []
    for strategy in ("single", "ddp", "auto"):  # auto decides offload itself
        cfg = JobConfig.model_validate({"parallel": {"cpu_offload": True, "strategy": strategy}})
        assert len(check_consistency(cfg)) == 1


@pytest.mark.parametrize("betas", ["[1.5, 0.9]", "[0.9, -0.1]", "[0.9, 1.0]"])
def test_adamw_betas_outside_0_1_are_rejected(betas):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"optim.betas={betas}"])
    assert all(p.startswith("optim.betas = ") for p in info.value.problems)


def test_a_config_file_that_is_not_utf8_is_one_clear_error(tmp_path):
    path = tmp_path / "job.toml"
    path.write_bytes(b"[optim]\nlr = 0.1 # \xff\xfe\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in info.value.problems[0] and "UTF-8" in info.value.problems[0]


# --- dump_toml -------------------------------------------------------------------------------


def _round_trip(cfg: JobConfig, tmp_path: Path) -> JobConfig:
    return load_config(_write(tmp_path, dump_toml(cfg), name="dumped.toml"))


def test_dump_toml_round_trip_defaults(tmp_path):
    cfg = load_config()
    assert _round_trip(cfg, tmp_path) == cfg


def test_dump_toml_round_trip_changed_config(tmp_path):
    cfg = load_config(
        overrides=[
            "model.name=pkg.mod:make",
            "data.dataset=digits",
            'model.kwargs={width = 8, act = "relu", nested = {a = [1, 2]}, "odd key" = 1.5}',
            "optim.betas=[0.8, 0.99]",  # a tuple field
            "cluster.nproc=3",  # a None default given a value
            "parallel.headroom=0.35",
            'logging.run_dir="runs/with \\"quotes\\" and spaces"',
        ]
    )
    assert cfg.optim.betas == (0.8, 0.99)
    back = _round_trip(cfg, tmp_path)
    assert back == cfg
    assert back.model.kwargs["nested"] == {"a": [1, 2]}
    assert back.optim.betas == (0.8, 0.99)


def test_dump_toml_unset_field_stays_unset(tmp_path):
    cfg = load_config(overrides=["cluster.nproc=3"])
    cfg.cluster.nproc = None  # set back to None after being given
    text = dump_toml(cfg)
    assert "# nproc = (unset)" in text
    assert _round_trip(cfg, tmp_path).cluster.nproc is None


def test_dump_toml_is_commented_with_descriptions():
    text = dump_toml(load_config())
    assert "[optim]" in text
    assert "# Peak learning rate." in text  # OptimConfig.lr's description


def test_job_hash_is_the_same_on_every_machine_of_a_job():
    from trainwise.config import job_hash

    two = {"cluster.nodes": 2}
    a = load_config(None, {**two, "cluster.node_rank": 0, "cluster.local_addr": "10.0.0.1"}, [])
    b = load_config(None, {**two, "cluster.node_rank": 1, "cluster.socket_ifname": "eth1"}, [])
    assert job_hash(a) == job_hash(b)
    assert job_hash(a) != job_hash(load_config(None, {**two, "optim.lr": 1e-2}, []))
