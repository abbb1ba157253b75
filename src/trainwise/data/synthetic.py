"""The built-in synthetic language: a seeded second-order Markov chain over token ids.

Nothing is downloaded; the corpus is generated on the fly and is identical for a given
(n_tokens, vocab_size, seed). Design, chosen so a tiny GPT learns it in minutes on a CPU:

* every token ``a`` has ``SUCCESSORS`` (4) distinct successor tokens, ``succ[a]``;
* the next token is always one of the current token's successors, drawn with the skewed
  probabilities ``SKEW`` (0.65, 0.2, 0.1, 0.05);
* which successor gets which probability depends on the *previous* token too: the pair
  (previous, current) picks one of the 24 orderings of the four slots from a seeded table.

So a model that only sees the current token can narrow the next one to four candidates
(about 1.2-1.3 nats), while one that also attends to the previous token reaches the entropy
rate of the process, exactly ``H(SKEW)`` = 0.98 nats/token for every vocab size and seed,
since every context has the same distribution up to a relabelling of four distinct tokens.
With vocab 256 that is far below the uniform loss ln(256) = 5.55.

Long corpora are many independent chains of ``CHAIN_LEN`` tokens, generated side by side
with one vectorised numpy step per position and concatenated. A chain starts at a random
(previous, slot) state, so about one token in ``CHAIN_LEN`` is not predictable.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from trainwise.errors import DataError

SUCCESSORS = 4
SKEW = (0.65, 0.2, 0.1, 0.05)
CHAIN_LEN = 1024
MAX_VOCAB = 1 << 16  # token ids are stored as uint16

# All orderings of the successor slots; row k gives, for each probability rank, the slot.
_ORDERINGS = np.array(list(itertools.permutations(range(SUCCESSORS))), dtype=np.int64)


def _check_vocab(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise DataError(f"data.vocab_size must be an integer, got {vocab_size!r}")
    if not SUCCESSORS <= vocab_size <= MAX_VOCAB:
        raise DataError(
            f"data.vocab_size={vocab_size} is out of range for the synthetic corpus; "
            f"use a value from {SUCCESSORS} to {MAX_VOCAB}"
        )


def _check_seed(seed: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise DataError(f"data seed must be a non-negative integer, got {seed!r}")


def _tables(vocab_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The process: ``succ[a, j]`` (j-th successor of token a) and ``order[a, j]`` (index
    into _ORDERINGS used when the previous token was a and the current is succ[a, j])."""
    rng = np.random.default_rng([seed, 0])
    v = vocab_size
    # Slot 0 follows one random cycle through every token, so the chain is irreducible
    # and every id in the vocabulary occurs.
    cycle = rng.permutation(v)
    sigma = np.empty(v, dtype=np.int64)
    sigma[cycle] = np.roll(cycle, -1)
    # Slots 1..3 add offsets from disjoint bands of [1, v-1], so successors are distinct.
    width = (v - 1) // (SUCCESSORS - 1)
    succ = np.empty((v, SUCCESSORS), dtype=np.int64)
    succ[:, 0] = sigma
    for j in range(1, SUCCESSORS):
        offset = 1 + (j - 1) * width + rng.integers(0, width, size=v)
        succ[:, j] = (sigma + offset) % v
    order = rng.integers(0, len(_ORDERINGS), size=(v, SUCCESSORS))
    return succ, order


def build_synthetic_corpus(n_tokens: int, vocab_size: int = 256, seed: int = 0) -> np.ndarray:
    """Return ``n_tokens`` token ids (uint16) of the synthetic language.

    Deterministic in (n_tokens, vocab_size, seed); a shorter corpus is a prefix of a longer
    one with the same vocab_size and seed.
    """
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 1:
        raise DataError(
            f"data.synthetic_tokens must be a positive integer, got {n_tokens!r}; use e.g. 1000000"
        )
    _check_vocab(vocab_size)
    _check_seed(seed)
    succ, order = _tables(vocab_size, seed)
    n_chains = -(-n_tokens // CHAIN_LEN)

    # One row of uniforms per chain, drawn row by row, keeps the prefix property.
    rng = np.random.default_rng([seed, 1])
    u = rng.random((n_chains, CHAIN_LEN + 1))
    prev = (u[:, 0] * vocab_size).astype(np.int64)
    prev_slot = (u[:, 1] * SUCCESSORS).astype(np.int64)
    # Probability rank of every step at once; the slot it maps to depends on the context.
    cum = np.cumsum(SKEW)
    cum[-1] = 1.0
    ranks = np.searchsorted(cum, u[:, 2:], side="right").T  # [CHAIN_LEN - 1, n_chains]

    out = np.empty((CHAIN_LEN, n_chains), dtype=np.uint16)
    cur = succ[prev, prev_slot]
    out[0] = cur
    for t in range(CHAIN_LEN - 1):
        slot = _ORDERINGS[order[prev, prev_slot], ranks[t]]
        prev, prev_slot = cur, slot
        cur = succ[cur, slot]
        out[t + 1] = cur
    return np.ascontiguousarray(out.T).reshape(-1)[:n_tokens]


def synthetic_entropy_rate(vocab_size: int = 256, seed: int = 0) -> float:
    """Entropy rate in nats/token of the process behind build_synthetic_corpus.

    Exact: every (previous, current) context puts the probabilities SKEW on four distinct
    successors, so the conditional entropy is H(SKEW) whatever the stationary distribution.
    (The successors are distinct by construction: see _tables.) This is the best loss a
    model can reach; chain starts add about ln(vocab_size)/CHAIN_LEN on top.
    """
    _check_vocab(vocab_size)
    _check_seed(seed)
    return -math.fsum(p * math.log(p) for p in SKEW)
