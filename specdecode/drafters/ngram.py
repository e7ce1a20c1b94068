"""Prompt-lookup drafting: copy what followed the last occurrence of the current suffix.

Code edits, summaries and retrieval answers repeat spans of their context; when the last ``n``
tokens occurred before, the tokens that followed them are a free guess. The index maps every
n-gram (``ngram_min <= n <= ngram_max``) to the position right after its earliest occurrence and is
updated incrementally, so a step costs O(ngram_max) dictionary look-ups, not a scan.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from specdecode.drafters.base import EMPTY_PROPOSAL, DraftProposal, SequenceState


class NgramDrafter:
    name: ClassVar[str] = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._index: dict[tuple[int, ...], int] = {}
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
                self._index.setdefault(tuple(tokens[end - n : end]), end)
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        tokens = seq.token_ids
        self._update(tokens)
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            follow = self._index.get(tuple(tokens[-n:]))
            if follow is not None:
                draft = tokens[follow : follow + k]
                return DraftProposal(torch.tensor(draft, dtype=torch.long), None)
        return EMPTY_PROPOSAL

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        """Stateless between steps apart from the index, which ``propose`` extends lazily."""
