"""Draft-model drafting: a small model of the same vocabulary proposes K tokens autoregressively.

Drafting stops early once the draft is unsure of its draft so far: when the product of the draft's
probabilities for its tokens (its own estimate that every one of them survives verification)
falls below ``confidence``, the last token is still proposed (verifying it costs almost nothing)
but no further tokens are drafted, since they would rarely survive and each costs a draft
forward. A running product rather than each token's own probability: a later token only counts
if all before it are accepted.

The draft keeps its own KV cache. It caches every committed token it has been fed; at each
``propose`` it first feeds the committed tokens it has not seen (the last token, and after a fully
accepted draft also the last draft token) in one forward, then drafts one token per forward.
Rejected drafts are rolled back with ``cache.trim``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor

from specdecode.drafters.base import DraftProposal, Drafter, SequenceState
from specdecode.errors import VocabularyMismatchError
from specdecode.models.decoder import Decoder
from specdecode.sample.sampling import greedy, logits_to_probs, sample


class DraftModelDrafter(Drafter):
    name: ClassVar[str] = "draft_model"

    def __init__(self, draft: Decoder, target_vocab_size: int, capacity: int, confidence: float = 0.0) -> None:
        if draft.config.vocab_size != target_vocab_size:
            raise VocabularyMismatchError(
                f"draft vocabulary has {draft.config.vocab_size} tokens but the target has "
                f"{target_vocab_size}; the draft model must share the target's tokenizer"
            )
        self.model = draft
        self.confidence = confidence
        self.cache = draft.new_cache(capacity)
        self._cached = 0  # committed tokens held in the draft cache

    def begin(self, seq: SequenceState) -> None:
        self.cache.reset()
        self._cached = 0

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        return self.draft(seq, k, seq.params.greedy, on_step=None)

    def draft(self, seq: SequenceState, k: int, argmax: bool,
              on_step: Callable[[Tensor], None] | None) -> DraftProposal:
        """Up to ``k`` tokens, each the draft's argmax (``argmax``) or a sample from its
        distribution under the request's sampling rule; ``on_step`` sees each step's logits [1, V]."""
        k = min(k, self.cache.capacity - len(seq.token_ids))
        if k <= 0:
            return DraftProposal(torch.empty(0, dtype=torch.long), None)
        pending = torch.tensor(seq.token_ids[self._cached :], dtype=torch.long)
        logits = self.model.forward(pending, self.cache, last_only=True)
        self._cached = len(seq.token_ids)
        params = seq.params
        tokens, probs = [], []
        cumulative = 1.0
        for i in range(k):
            if on_step is not None:
                on_step(logits)
            if argmax:
                token = greedy(logits)
                p_token = 1.0 if self.confidence <= 0 else float(torch.softmax(logits[0], -1)[token])
            else:
                p = logits_to_probs(logits, params)
                token = sample(p, seq.generator)
                probs.append(p[0])
                p_token = float(p[0, token])
            cumulative *= p_token
            sure = cumulative >= self.confidence
            tokens.append(token)
            if i + 1 == k or not sure:
                break
            logits = self.model.forward(token, self.cache)
        drafted = torch.cat(tokens)
        return DraftProposal(drafted, torch.stack(probs) if probs else None)

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        # The cache holds committed tokens plus drafts 1..K-1; keep the accepted drafts only.
        # When all K were accepted, draft K is not cached yet and is fed at the next propose.
        drafted_in_cache = self.cache.length - self._cached
        kept = min(n_accepted, drafted_in_cache)
        self.cache.trim(drafted_in_cache - kept)
        self._cached += kept
