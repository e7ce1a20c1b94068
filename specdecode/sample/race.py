"""Sampling as a race keyed by position: what makes a sampled output independent of the drafts.

The token at position t is ``argmax_v p_t(v) / E_{t,v}``, where the keys ``E_{t,v}`` are
independent Exp(1) draws made from the request's seed and the position t alone (the Gumbel-max
trick in its exponential form: the winner is v with probability exactly p_t(v)). The keys depend
on nothing a step decides (its drafts, its K, the requests beside it, the method), so a seeded
sampled request gives the same tokens whatever drafted them, and the same as plain sampled
decoding with that seed; an unseeded one has a random seed and the same law.

Verification is then greedy verification on the race's scores ``p / E``: a draft is kept iff it
is its row's winner, and the first row it is not gives the winner as the recovered token. Every
drafter is exact under it, whatever its proposals. A drafter that samples races with the same
keys (``DraftModelDrafter`` over its own distribution q): where q is close to p the two races
mostly pick the same token, so its drafts are accepted about as often as under the rejection rule.

A position's keys are ``-log U`` of uniform draws U (``torch.rand``, 24-bit floats in [0, 1)):
1.1-1.8 ms for 151,936 tokens against 3.5-4.4 ms through ``exponential_`` (AMD EPYC Zen 3,
torch 2.13, 2026-11-28; `python scripts/race_keys_time.py`), paid for every position a request
samples or drafts. U = 0, a chance of 2^-24 per key, gives an infinite key: that token cannot win
that position, a change of the law below 6e-8 a token. (``-log(1 - U)`` would instead give a
zero key, a winner whatever its probability, at some token of the vocabulary in one position of
a hundred.) ``RaceKeys`` keeps the keys of the positions a step may still ask for.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """A 64-bit seed for ``position``'s keys: splitmix64 of the request's seed and the position,
    so neighbouring positions and seeds get unrelated streams."""
    z = ((seed & _MASK64) + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def exponential_keys(generator: torch.Generator, n: int) -> Tensor:
    """``n`` Exp(1) keys, ``-log U`` of uniform draws in [0, 1) (a draw of 0: an infinite key)."""
    return torch.rand(n, generator=generator).log_().neg_()


class RaceKeys:
    """One request's race keys by position: a function of its seed, computed once per position."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._keys: dict[int, Tensor] = {}

    def at(self, position: int, vocab_size: int) -> Tensor:
        """The keys [vocab_size] of ``position`` (an index into the request's token ids)."""
        keys = self._keys.get(position)
        if keys is None or keys.shape[0] != vocab_size:
            keys = exponential_keys(torch.Generator().manual_seed(_mix(self.seed, position)), vocab_size)
            self._keys[position] = keys
        return keys

    def forget_before(self, position: int) -> None:
        """Drop the keys of positions already decided."""
        for old in [p for p in self._keys if p < position]:
            del self._keys[old]


def race_scores(probs: Tensor, keys: Tensor) -> Tensor:
    """probs [N, V] (or [V]), keys of the same shape -> the scores whose argmax is each row's winner."""
    return probs.float() / keys


def race(probs: Tensor, keys: Tensor) -> Tensor:
    """probs [N, V] (or [V]), keys of the same shape -> each row's winner, int64 [N] (or [])."""
    return race_scores(probs, keys).argmax(-1)
