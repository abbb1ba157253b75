"""Text from a trained model: greedy decoding (the most likely token each step, as
transformers' `generate(do_sample=False)`) or nucleus sampling (top-p, temperature,
seeded). The whole window runs every step (no key/value cache): a quick look at what a
fine-tune learned, not a serving engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainwise.errors import ConfigError
from trainwise.export.trained import Trained


@dataclass
class Sampling:
    """How the next token is chosen: greedy, or top-p at `temperature` from `seed`."""

    greedy: bool = True
    top_p: float = 1.0
    temperature: float = 1.0
    seed: int = 0

    def problems(self) -> list[str]:
        out = []
        if not 0.0 < self.top_p <= 1.0:
            out.append(f"--top-p {self.top_p}: give a probability in (0, 1], e.g. 0.9")
        if self.temperature <= 0.0:
            out.append(f"--temperature {self.temperature}: give a positive number, e.g. 0.8")
        return out


def next_token(logits: torch.Tensor, how: Sampling, generator: torch.Generator) -> int:
    """The next id from the last position's logits [vocab]."""
    if how.greedy:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / how.temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    # Keep the most likely tokens until their mass reaches top_p (the first always stays).
    before = sorted_probs.cumsum(0) - sorted_probs
    sorted_probs[before >= how.top_p] = 0.0
    pick = torch.multinomial(sorted_probs, 1, generator=generator)
    return int(order[pick])


@torch.no_grad()
def continue_ids(
    model: Trained, ids: list[int], max_new: int, how: Sampling
) -> list[int]:
    """Up to `max_new` ids after `ids`, stopping after the tokenizer's end-of-document."""
    generator = torch.Generator().manual_seed(how.seed)
    out = list(ids)
    for _ in range(max_new):
        window = out[-model.max_len :] if model.max_len else out
        logits = model.logits(torch.tensor([window]))[0, -1]
        token = next_token(logits, how, generator)
        out.append(token)
        if token == model.tokenizer.eos_id:
            break
    return out[len(ids) :]


def generate_text(model: Trained, prompt: str, max_new: int, how: Sampling) -> str:
    """The continuation of `prompt`, decoded (the end-of-document token left out)."""
    if not prompt:
        raise ConfigError("--prompt is empty: give the text to continue, e.g. --prompt 'Question:'")
    ids = model.tokenizer.encode_batch([prompt])[0]
    if model.max_len and len(ids) >= model.max_len:
        raise ConfigError(
            f"--prompt is {len(ids)} tokens, and the model takes {model.max_len} positions: "
            "shorten it to leave room for the answer"
        )
    new = continue_ids(model, ids, max_new, how)
    if new and new[-1] == model.tokenizer.eos_id:
        new = new[:-1]
    return decode(model, new)


def decode(model: Trained, ids: list[int]) -> str:
    try:
        return model.tokenizer.decode(ids)
    except UnicodeDecodeError:  # bytes cut inside a character: show what is whole
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
