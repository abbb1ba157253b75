"""A user's training script: its own model, defined here in __main__ (so it reaches the
workers by value), trained by `trainwise.train()` on the synthetic corpus with 2 CPU
workers. `python api_script.py RUN_DIR STEPS` prints the RunResult as one JSON line."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

import trainwise


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class TinyLM(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab]: what the synthetic corpus trains."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))  # the FSDP units
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build(vocab: int = 256, width: int = 16) -> nn.Module:
    return TinyLM(vocab, width)


if __name__ == "__main__":
    run_dir, steps = sys.argv[1], int(sys.argv[2])
    result = trainwise.train(
        model=build, nproc=2, steps=steps, run_dir=run_dir, oversubscribe=True, progress=True,
        data={"micro_batch": 4, "seq_len": 32},
        checkpoint={"interval": 2, "max_restarts": 1},
        logging={"tensorboard": False, "report": False},
        overrides={"parallel.timeout_s": 60},
    )
    print(json.dumps({
        "status": result.status,
        "run_dir": str(result.run_dir),
        "summary": result.summary.to_dict() if result.summary else None,
        "stop": result.stop.to_dict() if result.stop else None,
        "message": result.message,
        "exit_status": result.exit_status,
        "steps": [r.step for r in result.steps()],
    }))
