"""Predicted outputs (OpenAI's ``prediction``): the text a client expects, as a free draft source.

A coding tool that asks for an edit of a file knows most of the answer: the file. It sends it as
the prediction, and each step drafts the prediction's continuation from where the output is in
it. The output departs from it where the edit changes something (a renamed name, an inserted or
deleted line); the next steps find the output's place in it again: the longest suffix of the
output (up to ``MAX_MATCH`` tokens) that occurs in the prediction, the occurrence nearest after
the last alignment on ties (code repeats lines), so a copy resumes a few tokens after each edit.
The drafts are verified like any other, so the output is the target's whatever the prediction
says; a wrong prediction only costs the rows it adds, and the speculation policy weighs it
like any free source (it stops drafting from a prediction that keeps failing).
"""

from __future__ import annotations

import numpy as np

from specdecode.drafters.base import DraftSource, copy_source
from specdecode.params import MAX_SPECULATIVE_TOKENS
from specdecode.sequence import SequenceState

SOURCE = "prediction"
MAX_MATCH = 32  # the longest output suffix looked up in the prediction
MIN_REALIGN = 3  # a match elsewhere than where the output was expected must be this long
ACCEPTANCE_PRIOR = 0.9  # an aligned prediction is usually right: the client sent what it expects


class Prediction:
    """One request's predicted output as token ids, and where the output stands in it."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.expected = 0  # the prediction index the output's next token was expected at
        self.seen = 0  # output tokens at that lookup

    def source(self, seq: SequenceState) -> DraftSource | None:
        """The prediction's continuation from the output's place in it (None: no place found, or
        the prediction is used up)."""
        output = seq.token_ids[seq.prompt_len :]
        start = self._place(output)
        self.seen = len(output)
        if start is None or start >= len(self.tokens):
            return None
        self.expected = start
        draft = self.tokens[start : start + MAX_SPECULATIVE_TOKENS].tolist()
        return copy_source(SOURCE, draft, ACCEPTANCE_PRIOR)

    def _place(self, output: list[int]) -> int | None:
        """Index of the prediction token that should come next, or None."""
        if not output:
            return 0
        tail = np.asarray(output[-MAX_MATCH:], dtype=np.int64)
        ends = np.flatnonzero(self.tokens == tail[-1])  # occurrences of the last output token
        if not len(ends):
            return None
        lengths = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for back in range(2, len(tail) + 1):  # extend every candidate backwards while it matches
            prev = ends - (back - 1)
            alive &= prev >= 0
            alive[alive] = self.tokens[prev[alive]] == tail[-back]
            if not alive.any():
                break
            lengths[alive] += 1
        nexts = ends + 1
        new = min(len(output) - self.seen, len(tail))  # tokens committed since the last lookup
        followed = (nexts == self.expected + new) & (lengths >= max(new, 1))
        if followed.any():  # every new token was the prediction's: still aligned
            return int(nexts[followed][0])
        best = lengths.max()
        if best < MIN_REALIGN:
            return None
        candidates = nexts[lengths == best]
        ahead = candidates[candidates >= self.expected]
        return int(ahead[0] if len(ahead) else candidates[0])
