"""Checkpoint speed of trainwise against the disk it writes to, side by side.

One process builds a stack of Linear layers and takes one AdamW step, so that the state
(parameters + exp_avg + exp_avg_sq, fp32) is about --mb MB (1 MB = 10^6 bytes). Then, on
the same disk (--dir; default a temporary folder under the current directory, the disk
runs live on), each round times:

- raw write: that many bytes with os.write in 8 MB chunks, then fsync (the disk's
  sequential write speed: the ceiling for any save);
- torch.save of the model + optimizer state dict into one file, then fsync;
- trainwise sync save: Checkpointer.save(sync=True): DCP write, trainer.json, fsync of
  every file, the xxh3 checksum of every file into the manifest, rename (the commit);
- trainwise async save: the stall (how long save() blocks the loop: staging into host
  memory) and the total (until committed, through .wait());
- loads: Checkpointer.load and torch.load against a raw read of the raw file. Nothing is
  dropped from the page cache, so the reads are likely served from memory: they show the
  cost of deserialising, not the disk's read speed.

It prints the median of --rounds rounds per row: seconds, MB/s of the state's bytes, and
the ratio of that speed to the raw write (saves) or raw read (loads): 1.0 is as fast as
the raw disk, 0.5 takes twice as long. Then two targets: sync save >= 0.7 x raw write, and
async stall <= 0.1 x sync save. The checksum row is the hashing share of the sync save (paid
again on resume when checkpoint.verify = "full"). The two Checkpointers live through all
rounds, as in a run: the async one keeps its stager, and so its host buffers, between saves.

    .venv/bin/python bench/checkpoint.py                  # 300 MB, 3 rounds
    .venv/bin/python bench/checkpoint.py --mb 20 --rounds 1 --json

Not part of `make test`: its figures depend on the disk and on what else uses it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from trainwise.config.schema import CheckpointConfig
from trainwise.run.checkpoint import store as store
from trainwise.run.checkpoint.dcp import Checkpointer, Place, SaveSchedule
from trainwise.run.checkpoint.states import training_states

MB = 1e6
CHUNK = 8 << 20
LAYERS = 8
META = dict(
    strategy="single", dp_size=1, model="bench", model_spec={}, config_hash="bench", lineage={}
)
LOADS = ("raw read", "torch.load", "Checkpointer.load")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="trainwise checkpoint save/load vs the raw disk.")
    p.add_argument("--mb", type=float, default=300.0, help="state size in MB (default 300)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; medians are shown")
    p.add_argument("--dir", type=Path, default=Path("."), help="where to write (a temp dir)")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = p.parse_args(argv)
    if args.mb <= 0 or args.rounds < 1:
        p.error("--mb must be > 0 and --rounds >= 1")
    return args


def build(mb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """LAYERS square Linear layers whose parameters are a third of the state; one AdamW step
    fills exp_avg and exp_avg_sq (the other two thirds)."""
    width = max(8, round(math.sqrt(mb * MB / 3 / 4 / LAYERS)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(LAYERS)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).square().mean().backward()
    opt.step()
    return model, opt


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = [*model.state_dict().values()]
    tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def raw_write(path: Path, nbytes: int, block: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left > 0:
        left -= os.write(fd, block[: min(left, len(block))])
    os.fsync(fd)
    os.close(fd)


def raw_read(path: Path) -> None:
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def torch_save(path: Path, sd: dict) -> None:
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())


def checkpointer(work: Path, model, opt, async_save: bool) -> Checkpointer:
    """One per kind for the whole bench, as a run keeps one: later saves reuse its state."""
    cpu = torch.device("cpu")
    return Checkpointer(
        CheckpointConfig(**{"async": async_save, "keep_last": 100}),
        Place(work / "ckpt", work, rank=0, world=1, device=cpu),
        training_states([model], opt, 0, cpu),
        {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), "scaler": None},
        META,
        SaveSchedule(total_steps=10**6),
        logging.getLogger("bench"),
    )


def one_round(
    rnd: int, work: Path, cks: tuple, cks_state: tuple, nbytes: int, block: bytes
) -> dict:
    sync_ck, async_ck = cks
    t: dict[str, float] = {}
    raw, pt = work / "raw.bin", work / "state.pt"
    model, opt = cks_state
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    t["raw write"], _ = timed(lambda: raw_write(raw, nbytes, block))
    t["torch.save"], _ = timed(lambda: torch_save(pt, sd))
    sizes = {"torch.save file": pt.stat().st_size}
    step = 2 * rnd + 1  # distinct steps: the dirs of the rounds never collide
    t["sync save"], _ = timed(lambda: sync_ck.save(step, 0, time.time(), {}, sync=True))
    sync_dir = store.final_dir(work / "ckpt", step)
    sizes["checkpoint dir"] = store.dir_bytes(sync_dir)
    t["checksum (in sync save)"], _ = timed(lambda: store.scan_files(sync_dir))

    t0 = time.perf_counter()
    t["async stall"] = async_ck.save(step + 1, 0, time.time(), {})
    async_ck.wait()
    t["async total"] = time.perf_counter() - t0
    if not (store.final_dir(work / "ckpt", step + 1) / store.MANIFEST).is_file():
        sys.exit(f"async save of step {step + 1} left no committed checkpoint")
    shutil.rmtree(store.final_dir(work / "ckpt", step + 1))

    t["raw read"], _ = timed(lambda: raw_read(raw))
    t["torch.load"], _ = timed(lambda: torch.load(pt, weights_only=True))
    t["Checkpointer.load"], resumed = timed(lambda: sync_ck.load(sync_dir))
    if resumed.step != step:
        sys.exit(f"Checkpointer.load gave step {resumed.step}, saved {step}")
    shutil.rmtree(work / "ckpt")
    raw.unlink()
    pt.unlink()
    return {"seconds": t, "bytes": sizes}


def summarize(rounds: list[dict], nbytes: int) -> dict:
    med = {k: statistics.median(r["seconds"][k] for r in rounds) for k in rounds[0]["seconds"]}
    rows = []
    for what, s in med.items():
        base = med["raw read"] if what in LOADS else med["raw write"]
        rows.append({"what": what, "seconds": s, "mb_per_s": nbytes / MB / s, "ratio": base / s})
    targets = {
        "sync save >= 0.7 x raw write": med["raw write"] / med["sync save"] >= 0.7,
        "async stall <= 0.1 x sync save": med["async stall"] <= 0.1 * med["sync save"],
    }
    return {"rows": rows, "targets": targets, "median_s": med}


def print_table(rows: list[dict]) -> None:
    header = ("what", "seconds", "MB/s", "ratio to raw")
    lines = [
        (r["what"], f"{r['seconds']:.3f}", f"{r['mb_per_s']:,.0f}", f"{r['ratio']:.2f}")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in (header, *lines)) for i in range(len(header))]
    for row in (header, *lines):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # DCP warns once per call that it runs without a process group: that is the intent here.
    warnings.filterwarnings("ignore", message=".*assuming the intent is to")
    torch.manual_seed(0)
    model, opt = build(args.mb)
    nbytes = state_bytes(model, opt)
    block = os.urandom(CHUNK)  # incompressible, should the filesystem compress
    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trainwise-ckpt-bench-", dir=args.dir) as tmp:
        work = Path(tmp).resolve()
        cks = (checkpointer(work, model, opt, False), checkpointer(work, model, opt, True))
        print(
            f"checkpoint bench: {LAYERS} x Linear + AdamW state, {nbytes / MB:.1f} MB, "
            f"{args.rounds} round(s), in {work}",
            flush=True,
        )
        rounds = []
        for rnd in range(args.rounds):
            rounds.append(one_round(rnd, work, cks, (model, opt), nbytes, block))
            s = rounds[-1]["seconds"]
            print(
                f"  round {rnd + 1}/{args.rounds}: raw {s['raw write']:.3f} s, sync "
                f"{s['sync save']:.3f} s, async stall {s['async stall']:.3f} s",
                flush=True,
            )
        for ck in cks:
            ck.close()
    result = summarize(rounds, nbytes)
    sizes = {"state (tensors)": nbytes, "raw file": nbytes, **rounds[-1]["bytes"]}
    print()
    print_table(result["rows"])
    print("\nbytes: " + ", ".join(f"{k} {v:,}" for k, v in sizes.items()))
    for name, ok in result["targets"].items():
        print(f"target {name}: {'PASS' if ok else 'MISS'}")
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        payload = {"settings": settings, "bytes": sizes, **result, "rounds": rounds}
        print(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
