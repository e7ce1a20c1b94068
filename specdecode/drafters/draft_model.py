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
Rejected drafts are rolled back with ``cache.trim``. With a prefix cache for the draft model
(``prefixes``, ``models/prefix_cache.py``), a request starts from a copy of the longest cached
prefix of its prompt, and a finished request leaves a copy of its cache there, so the next turn of
a conversation catches up on the new tokens only. The draft's keys and values never change the
output, only which drafts are proposed.

A draft whose LM head is restricted to a subset of the vocabulary (``Decoder.restrict_vocabulary``)
drafts from that subset: its argmax, or a sample from its distribution renormalised over the
subset (``pick_from_subvocabulary``), which the exact rejection rule accepts like any other draft
distribution; a grammar's mask is read at the subset's ids.

Drafting is a coroutine of model calls (``Drafter.drafting``): in a batch of requests, the step
loop runs every request's call of one draft step as one forward (``Decoder.forward_batch``), so
the draft's weights are read once per draft step rather than once per request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from torch import Tensor

from specdecode.drafters.base import (CATCH_UP_TOKENS, Drafter, Drafting, ModelCall, pick_from_subvocabulary,
                                      run_alone)
from specdecode.params import SamplingParams
from specdecode.sequence import EMPTY_PROPOSAL, DraftProposal, SequenceState
from specdecode.models.prefix_cache import PrefixCache
from specdecode.errors import VocabularyMismatchError
from specdecode.models.decoder import Decoder
from specdecode.sample.grammar import apply_mask
from specdecode.sample.race import race
from specdecode.sample.sampling import greedy, logits_to_probs, sample


class DraftModelDrafter(Drafter):
    name: ClassVar[str] = "draft_model"
    draft_cost_prior: ClassVar[float] = 0.3  # an int4 0.5B draft's step against the 1.5B target's (0.24 on Zen 4)
    stops_by_confidence: ClassVar[bool] = True
    shares_forwards: ClassVar[bool] = True

    def __init__(self, draft: Decoder, target_vocab_size: int, capacity: int, confidence: float = 0.0,
                 prefixes: PrefixCache | None = None, temperature: float | None = None) -> None:
        """``temperature``: how it drafts for sampled requests (``SpecConfig.draft_temperature``):
        None by the request's own rule, 0 its argmax, t > 0 at temperature t."""
        # The draft's full vocabulary, even when its head computes only part of it.
        if draft.config.vocab_size != target_vocab_size:
            raise VocabularyMismatchError(
                f"draft vocabulary has {draft.config.vocab_size} tokens but the target has "
                f"{target_vocab_size}; the draft model must share the target's tokenizer"
            )
        self.model = draft
        self.vocab_size = target_vocab_size
        self.confidence = confidence
        self.cache = draft.new_cache(capacity)
        self._cached = 0  # committed tokens held in the draft cache
        self.prefixes = prefixes
        self.temperature = temperature

    def begin(self, seq: SequenceState) -> None:
        self.cache.reset()
        self._cached = 0 if self.prefixes is None else self.prefixes.restore(seq.token_ids, self.cache)

    def finish(self, seq: SequenceState) -> None:
        if self.prefixes is not None:  # slots past _cached may hold drafts of the last step
            self.prefixes.keep_copy(self.cache, seq.token_ids[: self._cached])

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        return run_alone(self.drafting(seq, k))

    def drafting(self, seq: SequenceState, k: int, argmax: bool | None = None,
                 on_step: Callable[[Tensor], None] | None = None) -> Drafting:
        """Up to ``k`` tokens, each the draft's argmax (``argmax``, default: the request is
        greedy or the drafter's temperature is 0) or a sample from its distribution under the
        request's sampling rule (at the drafter's temperature, when it has one); ``on_step`` sees
        each step's logits [1, V]. The first call feeds the committed tokens the draft cache lacks
        (a catch-up when they are many), each later one the last draft."""
        params = seq.params
        if argmax is None:
            argmax = params.greedy or self.temperature == 0
        if not argmax and self.temperature is not None:
            params = replace(params, temperature=self.temperature)
        run = _DraftRun(self, seq, min(k, self.cache.capacity - len(seq.token_ids)), argmax, params)
        if run.k <= 0:
            return EMPTY_PROPOSAL
        logits = yield ModelCall(self.model, run.take_pending(), self.cache, last_only=True)
        while True:
            if on_step is not None:
                on_step(logits)
            if not run.take(logits):
                return run.proposal()
            logits = yield ModelCall(self.model, run.tokens[-1], self.cache)

    def token_id(self, column: int) -> int:
        """The token id of column ``column`` of the draft's logits."""
        ids = self.model.vocab_ids
        return column if ids is None else int(ids[column])

    def catch_up(self, seq: SequenceState) -> int:
        # Up to CATCH_UP_TOKENS tokens ride a step's first draft forward, shared in a batch;
        # more take a forward of their own, a cost worth weighing.
        pending = len(seq.token_ids) - self._cached
        return pending if pending > CATCH_UP_TOKENS else 0

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        # The cache holds committed tokens plus drafts 1..K-1; keep the accepted drafts only.
        # When all K were accepted, draft K is not cached yet and is fed at the next propose.
        drafted_in_cache = self.cache.length - self._cached
        kept = min(n_accepted, drafted_in_cache)
        self.cache.trim(drafted_in_cache - kept)
        self._cached += kept


@dataclass(slots=True)
class _DraftRun:
    """One request's drafting in one step: the tokens so far and whether to draft another.

    Stepped with the draft's logits, alone or in a batch alike, so a request gets the same
    decisions (and, sampling, the same draws from its generator in the same order) either way.
    """

    drafter: DraftModelDrafter
    seq: SequenceState
    k: int
    argmax: bool
    params: SamplingParams  # the request's, or at the drafter's own temperature
    tokens: list[Tensor] = field(default_factory=list)
    probs: list[Tensor] = field(default_factory=list)
    cumulative: float = 1.0

    def take_pending(self) -> Tensor:
        """The committed tokens the draft cache lacks, counted as fed: the first forward's input."""
        d, ids = self.drafter, self.seq.token_ids
        pending = torch.tensor(ids[d._cached :], dtype=torch.long)
        d._cached = len(ids)
        return pending

    def take(self, logits: Tensor) -> bool:
        """Pick the next draft from the draft's logits [1, V] (V: its head's columns); True when
        another one is wanted (its forward is then due on ``tokens[-1]``). Under structured output
        the draft picks only among the tokens the grammar allows after its drafts so far, and
        stops when its head has none of them."""
        grammar, ids = self.seq.grammar, self.drafter.model.vocab_ids
        if grammar is not None:
            allowed = grammar.mask_after([int(t) for t in self.tokens])
            allowed = allowed if ids is None else allowed[ids]
            if not bool(allowed.any()):
                return False
            logits = apply_mask(logits, allowed.unsqueeze(0))
        need_prob = self.drafter.confidence > 0
        position = len(self.seq.token_ids) + len(self.tokens)  # the position this draft is for
        if ids is not None:
            choice, p, p_token = pick_from_subvocabulary(logits[0], ids, self.drafter.vocab_size, self.seq, need_prob,
                                                         argmax=self.argmax, position=position, params=self.params)
            token = torch.tensor([choice])
            if p is not None:
                self.probs.append(p)
        elif self.argmax:
            token = greedy(logits)
            p_token = float(torch.softmax(logits[0], -1)[token]) if need_prob else 1.0
        elif self.seq.keys is not None:  # the race the target runs at this position, over q
            p = logits_to_probs(logits, self.params)
            token = race(p, self.seq.keys.at(position, self.drafter.vocab_size)[None])
            p_token = float(p[0, token])
        else:
            p = logits_to_probs(logits, self.params)
            token = sample(p, self.seq.generator)
            self.probs.append(p[0])
            p_token = float(p[0, token])
        self.cumulative *= p_token
        self.tokens.append(token)
        ends = grammar is not None and int(token) in grammar.eos_ids
        return len(self.tokens) < self.k and self.cumulative >= self.drafter.confidence and not ends

    def proposal(self) -> DraftProposal:
        if not self.tokens:
            return EMPTY_PROPOSAL
        return DraftProposal(torch.cat(self.tokens), torch.stack(self.probs) if self.probs else None)
