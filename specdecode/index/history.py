"""Tokens of earlier requests, shared by every suffix drafter of one model.

Agents, code assistants and benchmark loops send requests that repeat earlier prompts and
outputs (SuffixDecoding, Oliaro et al. 2024, exploits exactly this); a request can then draft
from what previous requests produced. The history is bounded: past ``max_tokens`` the oldest
tokens are dropped, and it is thread-safe, as a server's concurrent requests add to it and
read it at once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from specdecode.index.ngram_table import DEFAULT_LEVELS, NgramTable, TableMatch

SEPARATOR = -1  # between requests: no context contains it, so no match crosses requests
DEFAULT_HISTORY_TOKENS = 1 << 20


class SuffixHistory:
    """A bounded, thread-safe record of finished requests' tokens (prompt + output).

    Memory is about 40 bytes per token (the tokens plus two sorted n-gram indexes), so the
    default of 2^20 tokens is ~40 MB. When an addition would pass ``max_tokens``, the oldest
    tokens are dropped down to 3/4 of it and the index is rebuilt; this happens once per
    ~max_tokens/4 added tokens, so it costs O(1) amortized per token.
    """

    def __init__(self, max_tokens: int = DEFAULT_HISTORY_TOKENS, levels: Sequence[int] = DEFAULT_LEVELS) -> None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
        self.max_tokens = max_tokens
        self.levels = tuple(levels)
        self._table = NgramTable(self.levels)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._table.size

    def add(self, tokens: Sequence[int]) -> None:
        """Record one finished request's tokens, followed by a separator."""
        new = [int(t) for t in tokens][-(self.max_tokens - 1) :] + [SEPARATOR]
        if len(new) == 1:
            return
        with self._lock:
            if self._table.size + len(new) > self.max_tokens:
                keep = max(0, (3 * self.max_tokens) // 4 - len(new))
                old = self._table.tokens()
                table = NgramTable(self.levels, self._table.cap)
                if keep:
                    table.extend(old[len(old) - keep :])
                self._table = table
            self._table.extend(new)

    def clear(self) -> None:
        """Forget every earlier request (a benchmark measures each request on its own)."""
        with self._lock:
            self._table = NgramTable(self.levels, self._table.cap)

    def match(self, context: Sequence[int], min_len: int, max_len: int) -> TableMatch | None:
        """The longest suffix of ``context`` seen in earlier requests (see ``NgramTable.match``).

        The match holds a snapshot of the tokens, so drafting from it needs no lock.
        """
        with self._lock:
            return self._table.match(context, min_len, max_len)
