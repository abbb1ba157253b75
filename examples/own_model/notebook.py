# %% [markdown]
# # Your own model, from a notebook
#
# A model class written here, in the notebook, planned and trained by trainwise on 2 CPU
# workers, its run read back as typed records, its weights exported and loaded back.
# Cells are marked `# %%` (VS Code, Jupytext, Spyder open them as a notebook); the file
# also runs top to bottom as a plain script:
#
#     python examples/own_model/notebook.py
#
# The class is defined in `__main__`, which no import path names, so trainwise sends it
# to the workers **by value** (pickled with cloudpickle: docs/api.md). The data is
# examples/own_model/my_model.py's: the JSONL files in data/ read by Hugging Face datasets.

# %%
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

import trainwise

HERE = Path(__file__).resolve().parent if "__file__" in globals() else Path.cwd()
sys.path.insert(0, str(HERE))  # my_model.py, wherever the kernel started
from my_model import SEQ, VOCAB, complete, held_out_loss, load_data  # noqa: E402

OUT = Path(os.environ.get("OWN_MODEL_NOTEBOOK_OUT", "runs/own-model-notebook"))
MARK = OUT / ".written-by-own-model-notebook"
if OUT.exists() and not MARK.is_file():
    raise SystemExit(f"{OUT} was not written by this notebook: set OWN_MODEL_NOTEBOOK_OUT")
shutil.rmtree(OUT, ignore_errors=True)  # a rerun of the notebook starts over
OUT.mkdir(parents=True)
MARK.write_text("written by examples/own_model/notebook.py; a rerun replaces it\n")

# %% [markdown]
# ## The model: causal convolutions over bytes
#
# The blocks sit in `blocks` and the forward skips the modules a pipeline stage lacks
# (None), so the same class also runs in stages (`parallel.pp = 2`).

# %%
class ConvBlock(nn.Module):
    """A causal depthwise convolution (each byte sees the 3 before it) and an MLP."""

    def __init__(self, dim: int, kernel: int = 4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, padding=kernel - 1)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        mixed = self.conv(self.norm1(h).transpose(1, 2))[..., :t]  # drop the look-ahead
        h = h + mixed.transpose(1, 2)
        return h + self.mlp(self.norm2(h))


class ConvLM(nn.Module):
    """bytes [B, T] -> logits [B, T, VOCAB]."""

    def __init__(self, dim: int = 64, depth: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(ConvBlock(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) if self.embed is not None else tokens
        for block in self.blocks:
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


JOB = {
    "data": {"micro_batch": 8, "global_batch": 16},
    "optim": {"lr": 5e-3},
    "schedule": {"warmup_steps": 5, "decay": "constant"},
    "train": {"eval_every": 10},
    "checkpoint": {"interval": 10},
}

# %% [markdown]
# ## Plan it: does it fit 2 CPU workers, how, how fast?

# %%
plan = trainwise.plan(JOB, model=ConvLM, data=load_data, gpus=2, gpu="cpu")
best = plan.recommendation
print(f"plan: fits {best.fits}; {best.configuration}; step {best.plan.step.total * 1e3:.1f} ms "
      f"planned; model read as: {plan.warnings[0]}")

# %% [markdown]
# ## Train it on 2 workers
#
# In Jupyter a progress bar follows the run; the interrupt button stops it after a save,
# and running the cell again resumes.

# %%
result = trainwise.train(JOB, model=ConvLM, data=load_data, nproc=2, steps=30,
                         run_dir=OUT / "run")
losses = [r.loss for r in result.steps()]
print(f"{result.status}: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
      f"held-out {result.summary.final_eval_loss:.3f}; model.name = {result.summary.model!r}")

# %% [markdown]
# ## Read the run back

# %%
report = trainwise.report(result.run_dir)
print(f"report: {report.headline.tokens_per_s:.0f} tokens/s; "
      f"{[a.title for a in report.advice][:2]}")

# %% [markdown]
# ## Export the weights and load them into the class
#
# `trainwise.export()` is `trainwise export RUN -o OUT` from Python: the checkpoint's
# weights in one safetensors file the class loads with strict names.

# %%
exported = trainwise.export(result.run_dir, OUT / "convlm.safetensors")
weights = exported.path
print(f"exported step {exported.step}: {exported.tensors} tensors, {exported.bytes} bytes")
from safetensors.torch import load_file  # noqa: E402

model = ConvLM()
model.load_state_dict(load_file(weights))
exported_loss = held_out_loss(model)
print(f"{weights}: held-out loss {exported_loss:.3f}; 'a dog ' -> "
      f"{complete(model, 'a dog ')!r}")

# %%
print(json.dumps({"status": result.status, "losses": losses, "model": result.summary.model,
                  "final_eval_loss": result.summary.final_eval_loss,
                  "exported_eval_loss": exported_loss, "export": str(weights),
                  "seq": SEQ}))
