"""An append-only token buffer with an n-gram index, for sources that grow while we draft.

A suffix array must be rebuilt when text is appended, which is too slow for a request's own
tokens (they grow every step) and for the history of earlier requests (it grows every request).
This table instead keys every position by hashes of the n-grams ending there, at a few fixed
lengths (``levels``), kept sorted so one ``searchsorted`` finds all candidates; appending t
tokens costs O(t log t + size) memory moves, no Python loop over the buffer.

The longest match is found from the longest level down: every occurrence of a match of length
>= L is among the candidates of level L, and numpy compares all candidates' preceding tokens
with the context at once (this also weeds out hash collisions). At most ``cap`` candidates are
checked per level, the most recent ones, so for a very common n-gram an older, longer match
can be missed; the draft is still valid, only perhaps shorter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specdecode.index.matches import copy_run, most_frequent
from specdecode.index.suffix_array import END

DEFAULT_LEVELS = (2, 8)
CANDIDATE_CAP = 4096
_PRIME = np.uint64(0x100000001B3)  # FNV-64 prime: multiplying spreads token ids over 64 bits


class NgramTable:
    """Tokens appended over time; ``match`` finds the longest suffix of a context among them.

    Matches shorter than the smallest level are never found, so it should be <= min_match.
    """

    def __init__(self, levels: Sequence[int] = DEFAULT_LEVELS, cap: int = CANDIDATE_CAP) -> None:
        self.levels = tuple(sorted({int(n) for n in levels}))
        if not self.levels or self.levels[0] < 1:
            raise ValueError(f"n-gram levels must be positive, got {levels}")
        self.cap = cap
        self.size = 0
        self._buf = np.empty(256, dtype=np.int32)
        self._keys = {n: np.empty(0, dtype=np.uint64) for n in self.levels}  # sorted
        self._ends = {n: np.empty(0, dtype=np.int64) for n in self.levels}  # by key, then position

    def tokens(self) -> np.ndarray:
        """The tokens so far, as a view that later appends never change."""
        return self._buf[: self.size]

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        new = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if not len(new):
            return
        old = self.size
        if old + len(new) > len(self._buf):  # grow by doubling: amortized O(1) per token
            buf = np.empty(max(2 * len(self._buf), old + len(new)), dtype=np.int32)
            buf[:old] = self._buf[:old]
            self._buf = buf
        self._buf[old : old + len(new)] = new
        self.size = old + len(new)
        for n in self.levels:
            # n-grams ending (exclusively) at old+1 .. size; the one ending at `old` is keyed already
            ends = np.arange(max(old + 1, n), self.size + 1, dtype=np.int64)
            if len(ends):
                self._insert(n, _hash_ngrams(self._buf, ends, n), ends)

    def _insert(self, n: int, keys: np.ndarray, ends: np.ndarray) -> None:
        order = np.argsort(keys, kind="stable")  # new positions stay in position order per key
        keys, ends = keys[order], ends[order]
        at = np.searchsorted(self._keys[n], keys, side="right")  # after older positions
        self._keys[n] = np.insert(self._keys[n], at, keys)
        self._ends[n] = np.insert(self._ends[n], at, ends)

    def match(self, context: Sequence[int], min_len: int, max_len: int) -> TableMatch | None:
        """The longest suffix of ``context`` (``min_len`` <= length <= ``max_len``) occurring
        here with at least one token after it, or None.

        An occurrence that ends at the end of the buffer has nothing to continue with and is
        ignored (for a request's own tokens that is the context itself).
        """
        top = min(max_len, len(context))
        if top < max(min_len, 1):
            return None
        tail = np.asarray(context[len(context) - top :], dtype=np.int64)
        for n in reversed(self.levels):
            if n > top:
                continue
            ends = self._candidates(n, tail[top - n :])
            ends = ends[ends < self.size]
            if not len(ends):
                continue
            lengths = self._match_lengths(ends, tail)
            best = int(lengths.max())
            if best >= max(n, min_len):
                return TableMatch(best, ends[lengths == best], self.tokens())
            if best >= n:  # the longest match is shorter than min_len; lower levels find no longer
                return None
        return None

    def _candidates(self, n: int, gram: np.ndarray) -> np.ndarray:
        key = _hash_ngrams(gram, np.array([n], dtype=np.int64), n)[0]
        keys = self._keys[n]
        lo, hi = np.searchsorted(keys, key, side="left"), np.searchsorted(keys, key, side="right")
        return self._ends[n][max(lo, hi - self.cap) : hi]  # the most recent `cap`

    def _match_lengths(self, ends: np.ndarray, tail: np.ndarray) -> np.ndarray:
        """How many tokens before each end equal the end of ``tail``, up to len(tail): all
        candidates and offsets compared at once (a handful of numpy calls, not a few a token)."""
        pos = ends[:, None] - np.arange(1, len(tail) + 1)  # [candidates, offsets]: the j-th token back
        same = (pos >= 0) & (self._buf[np.maximum(pos, 0)] == tail[::-1])
        return np.where(same.all(axis=1), len(tail), np.argmin(same, axis=1))


@dataclass(frozen=True, slots=True)
class TableMatch:
    """Occurrences of a matched context suffix in a table snapshot."""

    length: int
    ends: np.ndarray  # [m] position right after each occurrence (where its continuation starts)
    tokens: np.ndarray  # [size] the table's tokens when matched (a view later appends never touch)

    def continuation(self, k: int, min_share: float = 0.0) -> list[int]:
        out: list[int] = []
        pos, tokens = self.ends, self.tokens
        while len(out) < k and len(pos):
            if len(pos) == 1:  # one occurrence left: copy what follows it, up to the document's end
                out += copy_run(tokens, int(pos[0]), k - len(out))
                break
            nexts = np.full(len(pos), END, dtype=np.int64)
            inside = pos < len(tokens)
            nexts[inside] = tokens[pos[inside]]
            token, share = most_frequent(nexts)
            if token < 0 or share < min_share:
                break
            out.append(token)
            pos = pos[nexts == token] + 1
        return out


def _hash_ngrams(buf: np.ndarray, ends: np.ndarray, n: int) -> np.ndarray:
    """A 64-bit polynomial hash of ``buf[e - n : e]`` for each e in ``ends`` [m] (all e >= n)."""
    h = np.zeros(len(ends), dtype=np.uint64)
    for j in range(n, 0, -1):
        # +3 keeps the separator (-1) and END (-2) away from 0, which would hash like nothing
        h = h * _PRIME + (buf[ends - j].astype(np.int64) + 3).astype(np.uint64)
    return h
