"""Your own model and dataset through trainwise's Python API, end to end on this machine
(2 CPU workers, about a minute), nothing downloaded:

1. plan: `trainwise.plan()` reads TinyLM (my_model.py) on the meta device, measures it on
   a micro-batch of the data, and answers whether it fits on 2 CPU workers, in which
   layout and at what step time;
2. train: `trainwise.train()` on 2 workers, half the steps, on the JSONL files in data/
   (a Hugging Face DatasetDict: train, validation);
3. resume: the same call with all the steps continues from the first run's checkpoint;
4. export: `trainwise export RUN -o tinylm.safetensors`, the model's state dict in one
   safetensors file;
5. load it back into TinyLM with safetensors and evaluate: the held-out loss and a
   sentence the model completes.

    python examples/own_model/run.py [--out runs/own-model-example] [--steps 40]

The model and data go to the workers by import path (`my_model:TinyLM`,
`my_model:load_data`): trainwise puts this folder on their PYTHONPATH. Everything is
written under --out; the last line printed is JSON (what tests/e2e reads).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from my_model import TinyLM, complete, held_out_loss, load_data

import trainwise

MARK = ".written-by-own-model-example"
# The job, as a job file's sections: the same for the plan and both calls of train().
JOB = {
    "data": {"micro_batch": 8, "global_batch": 16},  # 8 a worker, 2 workers
    "optim": {"lr": 5e-3},
    "schedule": {"warmup_steps": 5, "decay": "constant"},  # the same whatever train.steps
    "train": {"eval_every": 10},
    "checkpoint": {"interval": 10},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/own-model-example", help="the folder to write")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in all")
    args = parser.parse_args()
    out = Path(args.out)
    problem = fresh_folder(out)
    if problem:
        print(f"run.py: {problem}", file=sys.stderr)
        return 2
    run_dir, weights = out / "run", out / "tinylm.safetensors"

    plan = trainwise.plan(JOB, model=TinyLM, data=load_data, gpus=2, gpu="cpu")
    best = plan.recommendation
    if not best.fits:  # the plan's questions say what would make it fit
        print(f"plan: it does not fit: {[q.answer for q in plan.questions]}", file=sys.stderr)
        return 1
    step_ms = best.plan.step.total * 1e3
    print(f"plan: fits {best.fits}; {best.configuration}; step {step_ms:.1f} ms planned")

    half = args.steps // 2
    first = trainwise.train(JOB, model=TinyLM, data=load_data, nproc=2, steps=half,
                            run_dir=run_dir)
    said = first.summary
    print(f"trained steps 1-{said.last_step} on {said.world} workers ({said.strategy}): "
          f"loss {said.first_loss:.3f} -> {said.final_loss:.3f}")

    second = trainwise.train(JOB, model=TinyLM, data=load_data, nproc=2, steps=args.steps,
                             run_dir=run_dir)  # the same job, more steps: it resumes
    again = second.summary
    print(f"resumed from step {again.resumed_from}, trained to step {again.last_step}: loss "
          f"-> {again.final_loss:.3f}, held-out {again.final_eval_loss:.3f}")

    trainwise_command("export", str(run_dir), "-o", str(weights))
    from safetensors.torch import load_file

    model = TinyLM()
    model.load_state_dict(load_file(weights))  # strict: every name and shape matches
    loss = held_out_loss(model)
    completion = complete(model, "the cat ")
    print(f"{weights} loaded into TinyLM: held-out loss {loss:.3f}; 'the cat ' -> "
          f"{completion!r}")

    steps = [r.loss for r in second.steps()]
    print(json.dumps({
        "plan": {"fits": best.fits, "configuration": best.configuration, "step_ms": step_ms},
        "first": {"last_step": said.last_step, "first_loss": said.first_loss,
                  "final_loss": said.final_loss},
        "second": {"resumed_from": again.resumed_from, "last_step": again.last_step,
                   "final_loss": again.final_loss, "final_eval_loss": again.final_eval_loss},
        "losses": steps, "export": str(weights), "exported_eval_loss": loss,
        "completion": completion,
    }))
    return 0


def fresh_folder(out: Path) -> str | None:
    """Empty `out` for this run; a folder this script did not write is never deleted
    (None, or why not)."""
    if out.exists() and any(out.iterdir()) and not (out / MARK).is_file():
        return f"--out {out} exists and was not written by this example; give a new folder"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / MARK).write_text("written by examples/own_model/run.py; a rerun replaces it\n")
    return None


def trainwise_command(*args: str) -> None:
    """`trainwise ARGS`, as typed at a shell."""
    print("$ trainwise " + " ".join(map(shlex.quote, args)), flush=True)
    subprocess.run([sys.executable, "-m", "trainwise", *args], check=True)


if __name__ == "__main__":
    sys.exit(main())
