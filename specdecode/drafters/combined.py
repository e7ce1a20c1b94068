"""Combined drafting: free copies from the context first, the draft model where it pays.

A copy from a context match (the request's own text, earlier requests, a datastore: the suffix
drafter's sources) costs nothing to draft and, when the answer repeats its context (code edits,
summaries, RAG, agents re-reading files), is accepted in long runs; the draft model costs a
forward per token but guesses well everywhere. Each step this drafter offers both (when the
context has a match) as ``DraftSource``s, and the speculation policy picks the one with the best
expected tokens per second from what it measured of each: a copy after a long match almost
always, the draft model after a short match it has seen fail. The draft model's cache catches
up on the tokens it did not see when it drafts next (one multi-token forward, which the policy
weighs as part of its cost).
"""

from __future__ import annotations

from typing import ClassVar

from specdecode.drafters.base import Drafter, Drafting, DraftSource, run_alone
from specdecode.drafters.cross_vocab import CrossVocabDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.sequence import DraftProposal, SequenceState


class CombinedDrafter(Drafter):
    name: ClassVar[str] = "combined"
    draft_cost_prior: ClassVar[float] = 0.3  # the draft model's, where the context has no match

    def __init__(self, draft: DraftModelDrafter | CrossVocabDrafter, copy: SuffixDrafter) -> None:
        self.draft, self.copy = draft, copy

    def begin(self, seq: SequenceState) -> None:
        self.copy.begin(seq)
        self.draft.begin(seq)

    def sources(self, seq: SequenceState) -> tuple[DraftSource, ...]:
        """A copy from the longest context match (when there is one), then the draft model."""
        return (*self.copy.sources(seq), *self.draft.sources(seq))

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        return run_alone(self.drafting(seq, k))

    def drafting(self, seq: SequenceState, k: int) -> Drafting:
        """From the first source: the copy when the context matches, else the draft model."""
        return (yield from self.sources(seq)[0].draft(seq, k))

    def catch_up(self, seq: SequenceState) -> int:
        return self.draft.catch_up(seq)

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        # The draft model rolls back only what it drafted itself this step (possibly nothing).
        self.draft.accept(seq, n_accepted)

    def finish(self, seq: SequenceState) -> None:
        self.copy.finish(seq)  # the request joins the history later requests copy from
        self.draft.finish(seq)
