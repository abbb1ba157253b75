"""How fast `trainwise plan` answers, as a whole process, against the time it takes Python
to start and import the config layer it stands on.

Each round runs, in fresh processes:
- python -c "pass": the interpreter alone;
- python -c "import trainwise.config": the floor every trainwise command pays;
- trainwise plan --json: the default plan;
- trainwise plan --json --sweep 1..4096: the default plan with a 13-point sweep (every
  named strategy and the search's best at each count; the issue's bar: under 1 s);
- the same for llama-70b on 1024 GPUs, 8 a node (the planner-search issue's job);
- python -c "import torch": what the plan avoids.

It prints the median wall time per row and its ratio to the sweep plan.

    .venv/bin/python bench/plan.py              # 5 rounds
    .venv/bin/python bench/plan.py --rounds 3
"""

from __future__ import annotations

import argparse
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
    "import torch": [sys.executable, "-c", "import torch"],
}
TARGETS = ("plan --sweep 1..4096", "plan 70b x 1024 --sweep 1..4096")


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in ROWS}
    for _ in range(args.rounds):
        for name, cmd in ROWS.items():  # interleaved, so a slow moment hits every row
            times[name].append(wall(cmd))
    ref = statistics.median(times["plan --sweep 1..4096"])
    print(f"{'process':28s} {'median s':>9s} {'x sweep plan':>13s}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:28s} {med:9.3f} {med / ref:13.2f}")
    for name in TARGETS:
        med = statistics.median(times[name])
        print(f"target: {name} under 1 s: {'met' if med < 1 else 'NOT met'} ({med:.2f} s)")


if __name__ == "__main__":
    main()
