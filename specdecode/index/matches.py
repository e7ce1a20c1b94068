"""What every retrieval source returns: a match of the context's suffix and its continuation.

The suffix drafter asks each source (the request's own tokens, earlier requests, a datastore)
for the longest suffix of the context it has seen, picks the longest, and asks that match for up
to ``k`` tokens. Each continuation step takes the most frequent next token over the match's
occurrences and keeps only the occurrences that continue with it, as REST and SuffixDecoding do:
the draft follows the path the data took most often, not one arbitrary occurrence.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Match(Protocol):
    length: int  # how many context tokens matched

    def continuation(self, k: int, min_share: float = 0.0) -> list[int]:
        """Up to ``k`` draft tokens; stops early at a document end or a weak majority."""


def most_frequent(nexts: np.ndarray) -> tuple[int, float]:
    """The most frequent value of ``nexts`` [m] (m > 0) and its share of ``nexts``.

    Negative values are outcomes too (the document or the data ends): when one wins, the caller
    stops drafting. Ties go to the value occurring last in ``nexts``, which for in-memory
    sources is the most recent occurrence; it keeps the choice deterministic.
    """
    values, inverse, counts = np.unique(nexts, return_inverse=True, return_counts=True)
    if len(values) == 1:
        return int(values[0]), 1.0
    last = np.zeros(len(values), dtype=np.int64)
    np.maximum.at(last, inverse.reshape(-1), np.arange(len(nexts)))
    tied = np.flatnonzero(counts == counts.max())
    best = tied[np.argmax(last[tied])]
    return int(values[best]), float(counts[best]) / len(nexts)


def copy_run(tokens: np.ndarray, start: int, n: int) -> list[int]:
    """Up to ``n`` tokens of ``tokens`` from ``start``, up to a document end (a negative value):
    a match with one occurrence left continues as that occurrence did."""
    run = tokens[start : start + n]
    ends = np.flatnonzero(run < 0)
    return (run[: ends[0]] if len(ends) else run).tolist()
