"""Combined drafting: the draft model, told in advance what the context suggests comes next.

Prompt lookup is free and, when the answer repeats the context (code edits, summaries, RAG),
its copies are long, but it drafts nothing on new text and copies blindly where the text
diverges; the draft model works everywhere but costs a forward per token. This drafter hands the
n-gram copy (when the current suffix of at least ``min_match`` tokens occurred before) to the
draft model as a guess: the draft scores the whole copy in one forward and keeps it exactly as
far as its own choices agree, then drafts on by itself (``DraftModelDrafter.draft``). Its drafts
are the draft model's own, at one forward for an agreed copy instead of one per token.

A draft of another vocabulary cannot score our tokens, so with one (``CrossVocabDrafter``) the
drafter falls back to choosing: the n-gram copy when there is one, else the draft model. The
draft model's cache catches up lazily on committed tokens it did not see.
"""

from __future__ import annotations

from typing import ClassVar

from specdecode.drafters.base import DraftProposal, SequenceState
from specdecode.drafters.cross_vocab import CrossVocabDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter


class CombinedDrafter:
    name: ClassVar[str] = "combined"

    def __init__(self, draft: DraftModelDrafter | CrossVocabDrafter, min_match: int = 3, ngram_max: int = 4) -> None:
        self.draft = draft
        self.ngram = NgramDrafter(ngram_min=min_match, ngram_max=max(min_match, ngram_max))

    def begin(self, seq: SequenceState) -> None:
        self.ngram.begin(seq)
        self.draft.begin(seq)

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        if isinstance(self.draft, DraftModelDrafter):
            copies = self.ngram.continuations(seq.token_ids, k, limit=1)
            return self.draft.draft(seq, k, seq.params.greedy, None, guess=copies[0] if copies else ())
        proposal = self.ngram.propose(seq, k)
        return proposal if proposal.k else self.draft.propose(seq, k)

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        # The draft model rolls back only what it drafted itself this step (possibly nothing).
        self.draft.accept(seq, n_accepted)
