"""`trainwise plan` as a user types it: the default plan, every output format, the job TOML,
bad input (one line, exit 2), and no torch import."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

from helpers import hang_limit, run_cli, run_limited
from trainwise.cli.main import main

pytestmark = pytest.mark.e2e


def plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_default_plan_prints_table_recommendation_and_the_three_questions(capsys):
    code, out, _ = plan(capsys)
    assert code == 0
    assert "llama-7b" in out and "8 x H100-SXM" in out
    for name in ("single", "ddp", "fsdp-grad-op", "fsdp-full", "fsdp-offload"):
        assert name in out
    assert not any(line.split()[:1] == ["hsdp"] for line in out.splitlines())  # one node
    flat = " ".join(out.split())
    # A layout over the 8 GPUs, sharded (one replica does not fit); which one is the
    # search's call (since FSDP's copies are priced once a step under stages: pp 2).
    chosen = re.search(r"Recommendation: (?:pp (\d+) x )?dp_replicate (\d+) x dp_shard (\d+) "
                       r"x tp (\d+) \((?:pp\d+ \+ )?fsdp", flat)
    assert chosen, flat
    assert math.prod(int(d or 1) for d in chosen.groups()) == 8, chosen.group(0)
    assert "Does one replica fit on one GPU? No." in " ".join(out.split())
    assert "Is the interconnect fast enough for sharding?" in out
    assert "What does a crash cost?" in out
    flat = " ".join(out.split())  # the terminal wraps long lines
    assert "compute +" in flat and "communication wait +" in flat and "failure retry =" in flat


def test_json_follows_the_schema_and_reads_back_the_flags(capsys):
    code, out, _ = plan(
        capsys,
        "--json",
        "--model", "llama-13b",
        "--gpus", "32",
        "--gpu", "A100-80GB",
        "--precision", "bf16",
        "--ac", "full",
        "--price", "1.5",
        "--sweep", "8..64",
    )
    assert code == 0
    record = json.loads(out)
    inputs = record["inputs"]
    assert (inputs["model"], inputs["gpus"], inputs["nodes"], inputs["gpu"]) == (
        "llama-13b",
        32,
        4,
        "A100-80GB",
    )
    assert (inputs["ac"], inputs["price_per_gpu_hour"]) == ("full", 1.5)
    names = [s["name"] for s in record["strategies"]]
    assert "hsdp" in names  # four nodes
    assert record["recommendation"]["strategy"] in names
    assert [q["question"] for q in record["questions"]][0] == "Does one replica fit on one GPU?"
    assert sorted({row["gpus"] for row in record["sweep"]}) == [8, 16, 32, 64]


def test_markdown_has_the_tables(capsys):
    code, out, _ = plan(capsys, "--markdown", "--model", "gpt2-124m", "--seq", "1024")
    assert code == 0
    assert out.startswith("# trainwise plan")
    assert "| strategy | n | params |" in out and "## The three questions" in out


def test_html_is_written(capsys, tmp_path: Path):
    page = tmp_path / "plan.html"
    code, _, _ = plan(capsys, "--html", str(page), "--sweep", "1..16")
    assert code == 0
    text = page.read_text()
    assert text.count("<svg") == 3 and "fsdp-full" in text


def test_plan_reads_the_train_job_file(capsys, tmp_path: Path):
    job = tmp_path / "job.toml"
    job.write_text(
        '[model]\nname = "small"\n[data]\nseq_len = 256\nmicro_batch = 4\n'
        '[train]\nsteps = 100\n[cluster]\nnproc = 2\ngpu = "L4"\n'
    )
    code, out, _ = plan(capsys, "--config", str(job), "--json")
    assert code == 0
    inputs = json.loads(out)["inputs"]
    # What `trainwise train` would run: 100 steps x 4 x 2 sequences x 256 tokens, fp32.
    assert (inputs["model"], inputs["gpus"], inputs["gpu"], inputs["precision"]) == (
        "small",
        2,
        "L4",
        "fp32",
    )
    assert inputs["tokens"] == 100 * 4 * 2 * 256


@pytest.mark.parametrize(
    "args, words",
    [
        (["--gpus", "0"], ["plan.gpus", "--gpus", "greater than 0"]),
        (["--price", "-1"], ["cost.price_per_gpu_hour", "--price"]),
        (["--seq", "0"], ["data.seq_len", "--seq"]),
        (["--hidden", "100", "--heads", "7"], ["d_model = 100", "n_head = 7"]),
        (["--gpu", "Z9000"], ["cluster.gpu", "H100-SXM", "A100-80GB"]),
        (["--sweep", "1..x"], ["--sweep", "1..1024"]),
        (["--sweep", "4,0"], ["--sweep", ">= 1"]),
        (["--tokens", "lots"], ["--tokens", "chinchilla"]),
        (["--model", "mypkg.models:build"], ["model.name", "cannot import", "PYTHONPATH"]),
        (["--params", "1000", "--layers", "2"], ["plan.params", "shape"]),
        (["--gpu", "T4", "--precision", "bf16"], ["T4", "--gpu-tflops"]),
        (["--strategy", "zero3"], ["plan.strategy", "fsdp-full"]),
        (["--gpus", "x"], ["--gpus 'x'", "whole number"]),
        (["--mtbf-hours", "inf"], ["cluster.mtbf_hours", "finite"]),
        (["--price", "nan"], ["cost.price_per_gpu_hour", "finite"]),
        (["--tokens", "inf"], ["--tokens", "chinchilla"]),
        (["--set", "plan.calibration='no-such-run'"], ["plan.calibration = 'no-such-run'"]),
        (["--calibrate", "no-such-run"], ["--calibrate no-such-run", "no such file or directory"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, words):
    code, out, err = plan(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("trainwise: error:")
    for word in words:
        assert word in lines[0]
    assert out == ""


def test_whole_numbers_may_be_written_in_e_notation(capsys):
    code, out, _ = plan(capsys, "--params", "3e9", "--json")
    assert code == 0
    assert json.loads(out)["inputs"]["params"] == 3_000_000_000


def test_plan_imports_no_torch(tmp_path: Path):
    code = (
        "import sys; from trainwise.cli.main import main; "
        "rc = main(['plan', '--json', '--sweep', '1..4096']); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"
    )
    res = run_limited([sys.executable, "-c", code], cwd=tmp_path, what="plan in a fresh process",
                      limit=hang_limit(procs=0))
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["sweep"][-1]["gpus"] == 4096


def test_plan_as_a_process(tmp_path: Path):
    res = run_cli("plan", "--gpus", "16", cwd=tmp_path, timeout=hang_limit(procs=0))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "hsdp" in res.stdout and "2 nodes" in res.stdout
