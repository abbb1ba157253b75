"""How fast `trainwise plan` answers, as a whole process, against the time it takes Python
to start and import the config layer it stands on.

Each round runs, in fresh processes:
- python -c "pass": the interpreter alone;
- python -c "import trainwise.config": the floor every trainwise command pays;
- trainwise plan --json: the default plan;
- trainwise plan --json --sweep 1..4096: the default plan with a 13-point sweep (every
  named strategy and the search's best at each count; the issue's bar: under 1 s);
- the same for llama-70b on 1024 GPUs, 8 a node (the planner-search issue's job);
- the same for Qwen3-235B-A22B (a Mixture-of-Experts model: expert degrees searched too);
- trainwise plan --json of Llama 3.1 405B on 16,384 H100 at Meta's batch and sequence
  (arXiv 2407.21783: 2,048 x 8,192 tokens), with the defaults: pipeline stages weighed by
  the search (issue 35's bar: under 1 s, a pipeline chosen, MFU within 15 % of Meta's
  41 %; the bench prints the layout and MFU it recommends);
- python -c "import torch": what the plan avoids.

It prints the median wall time per row, its ratio to the sweep plan, and the median CPU
time (user + system) of the process: on a shared machine the wall time grows with the
others' load, the CPU time much less, so it tells a slow moment from a slower planner.

    .venv/bin/python bench/plan.py              # 5 rounds
    .venv/bin/python bench/plan.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

ROWS = {
    "python": [sys.executable, "-c", "pass"],
    "import trainwise.config": [sys.executable, "-c", "import trainwise.config"],
    "plan": [sys.executable, "-m", "trainwise", "plan", "--json"],
    "plan --sweep 1..4096": [
        sys.executable,
        "-m",
        "trainwise",
        "plan",
        "--json",
        "--sweep",
        "1..4096",
    ],
    # The job: the search over every layout and knob at each of 13 counts.
    "plan 70b x 1024 --sweep 1..4096": [
        sys.executable,
        "-m",
        "trainwise",
        "plan",
        "--json",
        "--model",
        "llama-70b",
        "--gpus",
        "1024",
        "--gpus-per-node",
        "8",
        "--sweep",
        "1..4096",
    ],
    # A Mixture-of-Experts model: the same search with the expert degrees weighed too.
    "plan qwen3-235b x 1024 --sweep": [
        sys.executable, "-m", "trainwise", "plan", "--json", "--model", "qwen3-235b-a22b",
        "--gpus", "1024", "--gpus-per-node", "8", "--sweep", "1..4096",
    ],
    # Pipeline stages weighed by default: Meta's run (TP 8 x PP 16 x DP 128) as a user asks.
    "plan 405b x 16384": [
        sys.executable, "-m", "trainwise", "plan", "--json", "--model", "llama3-405b",
        "--gpus", "16384", "--seq", "8192", "--global-batch", "2048",
    ],
    "import torch": [sys.executable, "-c", "import torch"],
}
TARGETS = ("plan --sweep 1..4096", "plan 70b x 1024 --sweep 1..4096",
           "plan qwen3-235b x 1024 --sweep", "plan 405b x 16384")
# Meta's MFU on that layout (arXiv 2407.21783, Table 4: 38-41 %), and how near the plan's
# must come.
META_MFU, WITHIN = 0.41, 0.15


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one run of `cmd`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    walls: dict[str, list[float]] = {name: [] for name in ROWS}
    cpus: dict[str, list[float]] = {name: [] for name in ROWS}
    for _ in range(args.rounds):
        for name, cmd in ROWS.items():  # interleaved, so a slow moment hits every row
            wall, cpu = timed(cmd)
            walls[name].append(wall)
            cpus[name].append(cpu)
    ref = statistics.median(walls["plan --sweep 1..4096"])
    print(f"{'process':32s} {'median s':>9s} {'x sweep plan':>13s} {'CPU s':>6s}")
    for name in ROWS:
        med = statistics.median(walls[name])
        cpu = statistics.median(cpus[name])
        print(f"{name:32s} {med:9.3f} {med / ref:13.2f} {cpu:6.3f}")
    for name in TARGETS:
        med, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        verdict = "met" if med < 1 else "NOT met"
        print(f"target: {name} under 1 s: {verdict} ({med:.2f} s; CPU {cpu:.2f} s)")
    print(pipeline_verdict(ROWS["plan 405b x 16384"]))


def pipeline_verdict(cmd: list[str]) -> str:
    """What the 405B plan recommends, and whether it has pipeline stages and an MFU within
    WITHIN of Meta's."""
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rec = json.loads(out)["recommendation"]
    mfu, pp = rec["plan"]["mfu"], rec["layout"]["pp"]
    met = pp > 1 and abs(mfu / META_MFU - 1) <= WITHIN
    return (
        f"target: plan 405b x 16384 chooses pipeline stages at an MFU within "
        f"{WITHIN:.0%} of {META_MFU:.0%}: {'met' if met else 'NOT met'} "
        f"({rec['configuration']}; MFU {mfu:.1%})"
    )


if __name__ == "__main__":
    main()
