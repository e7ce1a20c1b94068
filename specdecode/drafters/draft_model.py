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

``draft_batch`` drafts for several requests at once (the server's concurrent requests): each
forward above runs once for all of them (``Decoder.forward_batch``), so the draft's weights are
read once per draft step rather than once per request.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from specdecode.drafters.base import Drafter
from specdecode.sequence import EMPTY_PROPOSAL, DraftProposal, SequenceState
from specdecode.errors import VocabularyMismatchError
from specdecode.models.cache import KVCache
from specdecode.models.decoder import Decoder
from specdecode.sample.grammar import apply_mask
from specdecode.sample.sampling import greedy, logits_to_probs, sample

# Catch-ups of at most this many tokens share one forward in ``draft_batch``. A longer one is a
# request's first (its whole prompt): a prefill, which runs alone on the model's prefill path
# rather than pushing the others' few rows off the decode kernels (e.g. an int4 draft's).
BATCHED_CATCH_UP = 4


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
        self._caught_up: tuple[int, float] | None = None  # the last catch-up forward: (tokens, seconds)

    def begin(self, seq: SequenceState) -> None:
        self.cache.reset()
        self._cached = 0

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        return self.draft(seq, k, seq.params.greedy, on_step=None)

    def draft(self, seq: SequenceState, k: int, argmax: bool,
              on_step: Callable[[Tensor], None] | None) -> DraftProposal:
        """Up to ``k`` tokens, each the draft's argmax (``argmax``) or a sample from its
        distribution under the request's sampling rule; ``on_step`` sees each step's logits [1, V]."""
        run = self._run(seq, k, argmax)
        if run.k <= 0:
            return EMPTY_PROPOSAL
        logits = self._feed(run.take_pending())
        while True:
            if on_step is not None:
                on_step(logits)
            if not run.take(logits):
                return run.proposal()
            logits = self.model.forward(run.tokens[-1], self.cache)

    def _run(self, seq: SequenceState, k: int, argmax: bool) -> _DraftRun:
        """This step's drafting state for ``seq``, ``k`` cut to what the draft cache still holds."""
        return _DraftRun(self, seq, min(k, self.cache.capacity - len(seq.token_ids)), argmax)

    def _feed(self, pending: Tensor) -> Tensor:
        """Run the committed tokens the cache lacks; the last row's logits [1, V]. A catch-up
        (more than ``BATCHED_CATCH_UP`` tokens) is timed for ``pop_catch_up``."""
        t0 = time.perf_counter()
        logits = self.model.forward(pending, self.cache, last_only=True)
        if pending.shape[0] > BATCHED_CATCH_UP:
            self._caught_up = (int(pending.shape[0]), time.perf_counter() - t0)
        return logits

    def catch_up(self, seq: SequenceState) -> int:
        # Up to BATCHED_CATCH_UP tokens ride a step's first draft forward, shared in a batch;
        # more take a forward of their own, a cost worth weighing.
        pending = len(seq.token_ids) - self._cached
        return pending if pending > BATCHED_CATCH_UP else 0

    def pop_catch_up(self) -> tuple[int, float] | None:
        timed, self._caught_up = self._caught_up, None
        return timed

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

    ``propose`` and ``draft_batch`` both step it with the draft's logits, so a request gets the
    same decisions (and, sampling, the same draws from its generator in the same order) either way.
    """

    drafter: DraftModelDrafter
    seq: SequenceState
    k: int
    argmax: bool
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
        """Pick the next draft from the draft's logits [1, V]; True when another one is wanted
        (its forward is then due on ``tokens[-1]``). Under structured output the draft picks only
        among the tokens the grammar allows after its drafts so far."""
        grammar = self.seq.grammar
        if grammar is not None:
            logits = apply_mask(logits, grammar.mask_after([int(t) for t in self.tokens]).unsqueeze(0))
        if self.argmax:
            token = greedy(logits)
            p_token = 1.0 if self.drafter.confidence <= 0 else float(torch.softmax(logits[0], -1)[token])
        else:
            p = logits_to_probs(logits, self.seq.params)
            token = sample(p, self.seq.generator)
            self.probs.append(p[0])
            p_token = float(p[0, token])
        self.cumulative *= p_token
        self.tokens.append(token)
        ends = grammar is not None and int(token) in grammar.eos_ids
        return len(self.tokens) < self.k and self.cumulative >= self.drafter.confidence and not ends

    def proposal(self) -> DraftProposal:
        return DraftProposal(torch.cat(self.tokens), torch.stack(self.probs) if self.probs else None)


def draft_batch(items: Sequence[tuple[DraftModelDrafter, SequenceState, int]]) -> list[DraftProposal]:
    """Each ``(drafter, seq, k)``'s ``drafter.propose(seq, k)``, with the draft forwards of
    drafters sharing a model run together: one catch-up forward, then one forward per draft step
    for the requests still drafting (each stops at its own ``k`` or confidence stop).

    A sampled request draws from its own generator in the same order as alone. A greedy request
    gets the same drafts as alone unless a batched forward's float rounding (the draft's kernels
    are not batch-invariant) flips a near-tie argmax; that changes only how many drafts the
    target accepts, never the output, which the target's exact verification decides alone.
    """
    groups: dict[int, list[int]] = defaultdict(list)
    for i, (drafter, _, _) in enumerate(items):
        groups[id(drafter.model)].append(i)
    proposals: list[DraftProposal] = [EMPTY_PROPOSAL] * len(items)
    for members in groups.values():
        runs = []
        for i in members:
            drafter, seq, k = items[i]
            runs.append(drafter._run(seq, k, seq.params.greedy))
        for i, proposal in zip(members, _draft_together(runs[0].drafter.model, runs)):
            proposals[i] = proposal
    return proposals


def _draft_together(model: Decoder, runs: list[_DraftRun]) -> list[DraftProposal]:
    """Step ``runs`` (drafters of ``model``) to their proposals, sharing every forward."""
    live = [run for run in runs if run.k > 0]
    logits = _catch_up(model, live)
    while live:
        live = [run for run, rows in zip(live, logits) if run.take(rows)]
        logits = _forward(model, [(run.tokens[-1], run.drafter.cache) for run in live])
    return [run.proposal() if run.tokens else EMPTY_PROPOSAL for run in runs]


def _catch_up(model: Decoder, runs: list[_DraftRun]) -> list[Tensor]:
    """Feed each run's pending committed tokens; the last row's logits [1, V] per run."""
    pending = [(run.take_pending(), run.drafter.cache) for run in runs]
    shared = [j for j, (tokens, _) in enumerate(pending) if tokens.shape[0] <= BATCHED_CATCH_UP]
    alone = [j for j, (tokens, _) in enumerate(pending) if tokens.shape[0] > BATCHED_CATCH_UP]
    logits: list[Tensor] = [torch.empty(0)] * len(runs)
    for j, rows in zip(shared, _forward(model, [pending[j] for j in shared], last_only=True)):
        logits[j] = rows
    for j in alone:
        logits[j] = runs[j].drafter._feed(pending[j][0])
    return logits


def _forward(model: Decoder, segments: list[tuple[Tensor, KVCache]], last_only: bool = False) -> list[Tensor]:
    """One draft forward for ``segments``; a lone one takes ``forward`` (and any fused path it has)."""
    if not segments:
        return []
    if len(segments) == 1:
        tokens, cache = segments[0]
        return [model.forward(tokens, cache, last_only=last_only)]
    return model.forward_batch(segments, last_only=last_only)
