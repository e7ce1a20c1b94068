"""Prompt-lookup drafting: copy what followed the last occurrence of the current suffix.

Code edits, summaries and retrieval answers repeat spans of their context; when the last ``n``
tokens occurred before, the tokens that followed them are a free guess. The index maps every
n-gram (``ngram_min <= n <= ngram_max``) to the position right after its earliest occurrence and is
updated incrementally, so a step costs O(ngram_max) dictionary look-ups, not a scan. It also
keeps a few later occurrences, so a tree drafter can branch on distinct continuations.

Why not the suffix drafter's matcher (``index.ngram_table``): that one counts every continuation
to pick the most frequent, across the request, earlier requests and a datastore; here the
earliest occurrence wins, whose continuation is the longest run to copy in an edit, and the index
is a plain dict grown token by token, the cheapest matcher for one request's own tokens. The
combined and tree drafters reuse this one.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from specdecode.config import NGRAM_MAX, NGRAM_MIN
from specdecode.drafters.base import Drafter, DraftSource, copy_source
from specdecode.drafters.suffix import COPY_ACCEPTANCE, match_bucket
from specdecode.params import MAX_SPECULATIVE_TOKENS
from specdecode.sequence import EMPTY_PROPOSAL, DraftProposal, SequenceState

MAX_OCCURRENCES = 4  # positions kept per n-gram: the earliest and the next few


class NgramDrafter(Drafter):
    name: ClassVar[str] = "ngram"

    def __init__(self, ngram_min: int = NGRAM_MIN, ngram_max: int = NGRAM_MAX) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def begin(self, seq: SequenceState) -> None:
        self._index.clear()
        self._indexed = 0
        self._update(seq.token_ids)

    def _update(self, tokens: list[int]) -> None:
        # Index n-grams that end strictly before the last token, so the current suffix never
        # matches itself; the earliest occurrence is kept, as its continuation is the longest.
        for end in range(max(self._indexed, 1), len(tokens)):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                follows = self._index.setdefault(tuple(tokens[end - n : end]), [])
                if len(follows) < MAX_OCCURRENCES:
                    follows.append(end)
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        found = self.continuations(seq.token_ids, k, limit=1)
        return DraftProposal(torch.tensor(found[0], dtype=torch.long), None) if found else EMPTY_PROPOSAL

    def sources(self, seq: SequenceState) -> tuple[DraftSource, ...]:
        """The continuation of the longest suffix that occurred before, named by that suffix's
        length as the suffix drafter names its copies (``suffix.match_bucket``): a copy after a
        one-token match is a far weaker bet than after four, so the policy learns each apart,
        starting from ``suffix.COPY_ACCEPTANCE``. None when nothing matches: a plain step."""
        found, n = self._matches(seq.token_ids, MAX_SPECULATIVE_TOKENS, limit=1)
        if not found:
            return ()
        bucket = match_bucket(n)
        return (copy_source(f"{self.name}/{bucket}", found[0], COPY_ACCEPTANCE[bucket]),)

    def continuations(self, tokens: list[int], k: int, limit: int) -> list[list[int]]:
        """Up to ``limit`` distinct continuations (each up to ``k`` tokens) of the longest suffix of
        ``tokens`` that occurred before, earliest occurrence first."""
        return self._matches(tokens, k, limit)[0]

    def _matches(self, tokens: list[int], k: int, limit: int) -> tuple[list[list[int]], int]:
        """``continuations`` and the length of the suffix they follow (0 when none)."""
        self._update(tokens)
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            follows = self._index.get(tuple(tokens[-n:]))
            if follows:
                found: list[list[int]] = []
                for start in follows:
                    draft = tokens[start : start + k]
                    if draft and draft not in found:
                        found.append(draft)
                    if len(found) == limit:
                        break
                return found, n
        return [], 0

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        """Stateless between steps apart from the index, which ``propose`` extends lazily."""
