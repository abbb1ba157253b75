"""The benchmarks still run against today's code (no figure is asserted: they print ratios
for people; a test only checks that they work and measure what they say)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import cli_env

REPO = Path(__file__).resolve().parents[2]


def test_the_checkpoint_bench_saves_and_loads_a_whole_state(tmp_path: Path):
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "checkpoint.py"), "--mb", "2", "--rounds", "1",
         "--dir", str(tmp_path), "--json"],
        capture_output=True, text=True, env=cli_env(), timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout[out.stdout.index("\n{") :])
    measured = {row["what"] for row in payload["rows"]}
    assert {"raw write", "sync save", "checksum (in sync save)", "Checkpointer.load"} <= measured
    state = payload["bytes"]["state (tensors)"]
    # The checkpoint holds the whole state, plus a little metadata.
    assert state <= payload["bytes"]["checkpoint dir"] < 1.1 * state
    assert not list(tmp_path.iterdir())  # its temporary folder is gone
