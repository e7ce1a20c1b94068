"""Suffix arrays over token ids: construction by prefix doubling, and pattern look-ups.

A suffix array lists the start of every suffix of ``tokens`` in lexicographic order, so all
occurrences of a pattern are one contiguous range of it, found by binary search in
O(len(pattern) log n), and extending the pattern by one token narrows the range. That is what
retrieval drafting needs: the longest context suffix seen before, then its most frequent
continuations, on a store of millions of tokens that is memory-mapped rather than loaded.

Construction is prefix doubling with numpy sorts (O(n log^2 n)); it is a few seconds for a few
million tokens, which is fine for an index built once and read many times.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence

import numpy as np

# Progress callback of the sort: (suffixes whose rank is already final, total suffixes).
SortProgress = Callable[[int, int], None]

END = -2  # "no next token": the suffix ends (shorter suffixes sort first)


def build_suffix_array(tokens: np.ndarray, progress: SortProgress | None = None) -> np.ndarray:
    """Start positions of the suffixes of ``tokens`` [n] (any integers) in lexicographic order.

    A suffix that is a proper prefix of another sorts first, as in Python's list comparison.
    Round r sorts suffixes by their first 2^r tokens, using the ranks of round r-1 for both
    halves; it stops once every rank is distinct, after about log2(longest repeat) rounds.
    Returns int32 when n < 2^31 (half the space on disk), else int64.
    """
    tokens = np.asarray(tokens)
    n = int(tokens.shape[0])
    out_dtype = np.int32 if n < 2**31 else np.int64
    if n == 0:
        return np.empty(0, dtype=out_dtype)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64).reshape(-1)  # dense, in [0, n)
    sa = np.argsort(rank, kind="stable")
    distinct = _rerank(rank, sa, rank[sa])
    width = 1
    while distinct < n:
        if progress is not None:
            progress(distinct, n)
        # Key of suffix i: (rank of its first `width` tokens, rank of the next `width` or 0 if none).
        key = rank * (n + 1)
        key[: n - width] += rank[width:] + 1
        sa = np.argsort(key)  # ties have equal ranks afterwards, so their order does not matter
        distinct = _rerank(rank, sa, key[sa])
        width *= 2
    if progress is not None:
        progress(n, n)
    return sa.astype(out_dtype)


def _rerank(rank: np.ndarray, sa: np.ndarray, sorted_keys: np.ndarray) -> int:
    """Write dense ranks of ``sorted_keys`` back into ``rank`` (in place); return how many differ."""
    new = np.empty(len(sa), dtype=np.int64)
    new[0] = 0
    np.cumsum(sorted_keys[1:] != sorted_keys[:-1], out=new[1:])
    rank[sa] = new
    return int(new[-1]) + 1


class SuffixIndex:
    """Look-ups in ``tokens`` [n] through its suffix array ``sa`` (both may be memory-mapped).

    ``sa`` may omit suffixes that start with a token no pattern contains (the datastore drops its
    document separators); every other suffix must be present, in order.
    """

    def __init__(self, tokens: np.ndarray, sa: np.ndarray) -> None:
        self.tokens = tokens
        self.sa = sa
        self.n = int(tokens.shape[0])

    def prefix(self, i: int, m: int) -> list[int]:
        """The first ``m`` tokens of the ``i``-th smallest suffix (fewer if it is shorter)."""
        start = int(self.sa[i])
        return self.tokens[start : start + m].tolist()

    def find(self, pattern: Sequence[int], lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        """The range [lo, hi) of suffix-array rows that start with ``pattern`` (empty: lo == hi).

        ``lo``/``hi`` restrict the search to a range known to contain all matches (e.g. the
        range of a prefix of ``pattern``).
        """
        hi = len(self.sa) if hi is None else hi
        pattern = list(pattern)
        m = len(pattern)
        rows = range(lo, hi)
        first = bisect_left(rows, pattern, key=lambda i: self.prefix(i, m))
        last = bisect_right(rows, pattern, lo=first, key=lambda i: self.prefix(i, m))
        return lo + first, lo + last

    def longest_suffix_match(self, context: Sequence[int], min_len: int, max_len: int) -> tuple[int, int, int]:
        """The longest suffix of ``context`` (``min_len`` <= length <= ``max_len``) that occurs.

        Returns (length, lo, hi) with the rows of its occurrences, or (0, 0, 0) if none occurs.
        Occurrence is monotone (if a suffix occurs, so do its own suffixes), so the length is
        found by binary search: O(log max_len) range searches.
        """
        best = (0, 0, 0)
        low, high = min_len, min(max_len, len(context))
        while low <= high:
            mid = (low + high) // 2
            lo, hi = self.find(context[len(context) - mid :])
            if hi > lo:
                best = (mid, lo, hi)
                low = mid + 1
            else:
                high = mid - 1
        return best

    def next_token(self, i: int, depth: int) -> int:
        """The token after the first ``depth`` tokens of the ``i``-th suffix, or END."""
        pos = int(self.sa[i]) + depth
        return int(self.tokens[pos]) if pos < self.n else END

    def next_tokens(self, lo: int, hi: int, depth: int, cap: int) -> np.ndarray:
        """Next tokens after ``depth`` tokens for at most ``cap`` rows evenly spread over [lo, hi).

        Within a range whose suffixes share their first ``depth`` tokens the rows are sorted by
        the next token, so each distinct next token is a run of rows; an evenly strided sample
        estimates every run's length to within (hi - lo) / cap rows.
        """
        count = min(hi - lo, cap)
        rows = lo + (np.arange(count, dtype=np.int64) * (hi - lo)) // count
        pos = np.asarray(self.sa[rows], dtype=np.int64) + depth
        out = np.full(count, END, dtype=np.int64)
        inside = pos < self.n
        out[inside] = self.tokens[pos[inside]]
        return out

    def narrow(self, lo: int, hi: int, depth: int, token: int) -> tuple[int, int]:
        """The sub-range of [lo, hi) (sharing ``depth`` tokens) whose next token is ``token``."""
        rows = range(lo, hi)
        first = bisect_left(rows, token, key=lambda i: self.next_token(i, depth))
        last = bisect_right(rows, token, lo=first, key=lambda i: self.next_token(i, depth))
        return lo + first, lo + last
