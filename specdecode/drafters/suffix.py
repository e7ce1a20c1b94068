"""Retrieval drafting (REST, He et al. 2024; SuffixDecoding, Oliaro et al. 2024): continue the
longest suffix of the context that was seen before, the way the seen text most often went on.

Three sources, in priority order: the request's own tokens (prompt + output so far; prompt
lookup with frequencies), a ``SuffixHistory`` of earlier requests shared by the drafters of one
model, and an optional on-disk ``Datastore`` (``specdecode index build``). The longest match
wins; on equal length the earlier source wins, as the request's own text predicts it best. A
source whose match yields no token (e.g. the document ends right there) yields to the next.

Drafts are deterministic (``probs=None``), so the engine's exact acceptance rules keep the
output identical to the target's for greedy and sampled decoding alike. A step costs a few
numpy operations on the in-memory sources and O(log n) reads of the memory-mapped store.

Lifecycle: the engine calls ``begin(seq)`` per request, then ``propose`` / ``accept`` per step.
A request's tokens join the shared history when ``finish(seq)`` is called, or at the drafter's
next ``begin`` if nobody called ``finish``; a drafter that serves only one request must have
``finish`` called for that request to reach the history.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from specdecode.drafters.base import Drafter, DraftSource, copy_source
from specdecode.sequence import EMPTY_PROPOSAL, DraftProposal, SequenceState
from specdecode.errors import InvalidConfigError
from specdecode.index.datastore import Datastore
from specdecode.index.history import SuffixHistory
from specdecode.index.matches import Match
from specdecode.index.ngram_table import NgramTable
from specdecode.params import MAX_SPECULATIVE_TOKENS
from specdecode.tokenizer import Tokenizer

__all__ = ["SuffixDrafter", "SuffixHistory"]

_LONG_LEVEL = 8  # the own-context table's second n-gram level (see NgramTable)
MATCH_BUCKETS = (1, 4, 8, 16)  # lower bounds of the match lengths a copy's acceptance is learned by
# What a copy after a match of each bucket's length is accepted at, before a process has measured
# it: the pooled rate over the built-in workloads (`python scripts/source_acceptance.py`, combined,
# 3 prompts a workload, 128 tokens; 2026-11-26): a two-token match is a coin toss, a long one
# almost sure. A single prior for all would try short copies where the draft model does better.
COPY_ACCEPTANCE = {"match1": 0.5, "match4": 0.7, "match8": 0.85, "match16": 0.9}


def match_bucket(length: int) -> str:
    """A match length's bucket, e.g. "match4" for 4..7 tokens: the name a copy's acceptance is
    learned under."""
    return f"match{max(b for b in MATCH_BUCKETS if b <= max(length, 1))}"


class SuffixDrafter(Drafter):
    name: ClassVar[str] = "suffix"

    def __init__(
        self,
        datastore: Datastore | None = None,
        history: SuffixHistory | None = None,
        max_match: int = 32,
        min_match: int = 2,
        min_share: float = 0.0,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """``max_match`` / ``min_match``: the longest context suffix searched for, and the
        shortest match worth drafting from. ``min_share``: stop a draft when its next token
        follows fewer than this share of the remaining occurrences (0: never; the engine's
        adaptive draft length already trims drafts that keep failing). ``tokenizer``: the
        model's; when given with a datastore, a store built for another tokenizer raises
        ``DatastoreError`` (pass it unless the store was opened with it already)."""
        if not 1 <= min_match <= max_match:
            raise InvalidConfigError(f"need 1 <= min_match <= max_match, got min_match={min_match}, "
                                     f"max_match={max_match}")
        if not 0.0 <= min_share <= 1.0:
            raise InvalidConfigError(f"min_share must be in [0, 1], got {min_share}")
        if datastore is not None and tokenizer is not None:
            datastore.check_tokenizer(tokenizer)
        self.datastore, self.history = datastore, history
        self.max_match, self.min_match, self.min_share = max_match, min_match, min_share
        self._levels = (min_match, max(min_match, min(_LONG_LEVEL, max_match)))
        self._own = NgramTable(self._levels)
        self._seq: SequenceState | None = None  # the request being drafted, not yet in the history

    def begin(self, seq: SequenceState) -> None:
        self.finish()  # the previous request, unless its finish() was called already
        self._seq = seq
        self._own = NgramTable(self._levels)
        self._own.extend(seq.token_ids)

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        draft, _ = self.lookup(seq, k)
        return DraftProposal(torch.tensor(draft, dtype=torch.long), None) if draft else EMPTY_PROPOSAL

    def sources(self, seq: SequenceState) -> tuple[DraftSource, ...]:
        """The continuation of the longest match, named by how long the match is: a copy after a
        long match is a much safer bet than after a two-token one, so the policy learns each
        bucket's acceptance apart (see ``match_bucket``). None when nothing matches."""
        draft, length = self.lookup(seq, MAX_SPECULATIVE_TOKENS)
        if not draft:
            return ()
        bucket = match_bucket(length)
        return (copy_source(f"{self.name}/{bucket}", draft, COPY_ACCEPTANCE[bucket]),)

    def lookup(self, seq: SequenceState, k: int) -> tuple[list[int], int]:
        """Up to ``k`` draft tokens continuing ``seq`` and the length of the match they follow
        (([], 0) when nothing matches)."""
        if seq is not self._seq:  # a caller that skipped begin(): start this request now
            self.begin(seq)
        tokens = seq.token_ids
        self._own.extend(tokens[self._own.size :])  # committed tokens only grow within a request
        if k <= 0:
            return [], 0
        return self._draft(tokens[-self.max_match :], k)

    def _draft(self, context: list[int], k: int) -> tuple[list[int], int]:
        """From the longest match over the sources; among equals the earlier source first."""
        longest_possible = min(self.max_match, len(context))
        shorter: list[Match] = []
        for source in (self._own, self.history, self.datastore):
            match = source.match(context, self.min_match, self.max_match) if source is not None else None
            if match is None:
                continue
            if match.length < longest_possible:
                shorter.append(match)
                continue
            draft = match.continuation(k, self.min_share)  # nothing later can be longer: skip it
            if draft:
                return draft, match.length
        for match in sorted(shorter, key=lambda m: -m.length):  # stable: keeps source priority
            draft = match.continuation(k, self.min_share)
            if draft:
                return draft, match.length
        return [], 0

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        """No per-step state to roll back: the tables hold committed tokens only."""

    def finish(self, seq: SequenceState | None = None) -> None:
        """The request ended: add its tokens (prompt + output) to the shared history, once.

        ``seq`` defaults to the current request; a ``seq`` this drafter is not drafting is
        ignored, so calling ``finish`` twice or late never adds a request twice.
        """
        current = self._seq
        if current is None or (seq is not None and seq is not current):
            return
        self._seq = None
        if self.history is not None:
            self.history.add(current.token_ids)
