"""Combined drafting: copy from the context when it has a strong match, else ask the draft model.

Prompt lookup is free and, when the answer repeats the context (code edits, summaries, RAG),
accepts long runs; the draft model costs a forward per token but works everywhere. This drafter
uses an n-gram match when the current suffix of at least ``min_match`` tokens occurred before,
and the draft model otherwise. The draft model's cache catches up lazily on the committed tokens
it did not see, so switching between the two costs one multi-token draft forward.
"""

from __future__ import annotations

from typing import ClassVar

from specdecode.drafters.base import Drafter, Drafting, run_alone
from specdecode.sequence import DraftProposal, SequenceState
from specdecode.drafters.cross_vocab import CrossVocabDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter


class CombinedDrafter(Drafter):
    name: ClassVar[str] = "combined"
    draft_cost_prior: ClassVar[float] = 0.4  # the draft model's, where the context has no match

    def __init__(self, draft: DraftModelDrafter | CrossVocabDrafter, min_match: int = 3, ngram_max: int = 4) -> None:
        self.draft = draft
        self.ngram = NgramDrafter(ngram_min=min_match, ngram_max=max(min_match, ngram_max))

    def begin(self, seq: SequenceState) -> None:
        self.ngram.begin(seq)
        self.draft.begin(seq)

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        return run_alone(self.drafting(seq, k))

    def drafting(self, seq: SequenceState, k: int) -> Drafting:
        proposal = self.ngram.propose(seq, k)
        return proposal if proposal.k else (yield from self.draft.drafting(seq, k))

    def catch_up(self, seq: SequenceState) -> int:
        return self.draft.catch_up(seq)

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        # The draft model rolls back only what it drafted itself this step (possibly nothing).
        self.draft.accept(seq, n_accepted)
