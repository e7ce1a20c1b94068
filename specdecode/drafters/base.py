"""The drafter contract shared by every speculative method.

A drafter sees the committed tokens of one sequence and proposes up to ``k`` continuations. The
engine verifies them with the target and tells the drafter how many were kept, so a stateful
drafter (one with its own KV cache) can roll back. Drafters declare what they need; the engine
never branches on a method's name.

A drafter that runs a model of its own writes its drafting as a coroutine (``drafting``) that
yields each forward it needs as a ``ModelCall`` and receives the logits. The engine's step loop
gathers the calls of every request at once and runs the calls on one model as one batched
forward, so requests drafting with one draft model (``draft_model``, ``combined``, ``tree``,
``self``) read its weights once per draft step, whatever drafter wraps it; alone, ``run_alone``
answers each call with a forward of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeAlias

import torch
from torch import Tensor

from specdecode.params import SamplingParams
from specdecode.sample.race import race
from specdecode.sample.sampling import logits_to_probs, sample
from specdecode.sequence import DraftProposal, SequenceState

if TYPE_CHECKING:
    from specdecode.models.cache import KVCache
    from specdecode.models.decoder import Decoder


@dataclass(frozen=True, slots=True)
class ModelCall:
    """One forward a drafter needs from its model: ``tokens`` [n] run on ``cache``; the answer
    is the logits ([1, V] with ``last_only``, else [n, V])."""

    model: Decoder
    tokens: Tensor
    cache: KVCache
    last_only: bool = False

    def run(self) -> Tensor:
        return self.model.forward(self.tokens, self.cache, last_only=self.last_only)


# A call that feeds more than this many tokens is a catch-up (a prompt, or the tokens of steps
# drafted without the model): a prefill, which runs alone on the model's prefill path rather than
# pushing other requests' few rows off the decode kernels (e.g. an int4 draft's).
CATCH_UP_TOKENS = 4

# A drafting coroutine: yields the model calls it needs, is sent their logits, returns the proposal.
Drafting: TypeAlias = Generator[ModelCall, Tensor, DraftProposal]


@dataclass(frozen=True, slots=True, eq=False)
class DraftSource:
    """One way a drafter can draft the coming step, as the speculation policy weighs it.

    Most drafters have one source: themselves. A drafter with several (``combined``: a copy from
    a context match when there is one, and the draft model) offers each, and the policy picks the
    one with the best expected tokens per second from what it measured of each. ``name`` is what
    the policy learns acceptance and cost under: the method's name, or ``method/source`` (a copy
    from a long match is a different bet from a copy from a short one).
    """

    name: str
    cost_prior: float  # a drafted token's cost as a share of a target step, until measured
    draft: Callable[[SequenceState, int], Drafting]  # (seq, k) -> the drafting coroutine
    limit: int | None = None  # the most drafts it can give now (a match's continuation); None: any
    catch_up: int = 0  # tokens its model must feed first (``Drafter.catch_up``)
    # sets the confidence stop of this step's drafting (``Drafter.set_confidence``); None: it has none
    stop: Callable[[float | None], None] | None = None
    # the acceptance it starts from before any of its drafts were verified; None: the policy's
    acceptance_prior: float | None = None
    shared: bool = False  # its model calls join other requests' in one forward (``Drafter.shares_forwards``)


def copy_source(name: str, tokens: list[int], acceptance_prior: float | None = None) -> DraftSource:
    """A free source proposing the first k of ``tokens`` (a match's continuation)."""

    def draft(seq: SequenceState, k: int) -> Drafting:
        return DraftProposal(torch.tensor(tokens[:k], dtype=torch.long), None)
        yield  # a generator function: the proposal is its return value

    return DraftSource(name, 0.0, draft, limit=len(tokens), acceptance_prior=acceptance_prior)


def run_alone(drafting: Drafting) -> DraftProposal:
    """Drive one drafting coroutine, each model call a forward of its own."""
    try:
        call = next(drafting)
        while True:
            call = drafting.send(call.run())
    except StopIteration as done:
        return done.value


def pick_from_subvocabulary(logits: Tensor, target_ids: Tensor, vocab_size: int, seq: SequenceState,
                            need_prob: bool, argmax: bool | None = None, position: int | None = None,
                            params: SamplingParams | None = None) -> tuple[int, Tensor | None, float]:
    """One draft token from logits over a subset of the target vocabulary (a trained head's own
    vocabulary, or a draft model's restricted LM head), ``target_ids`` the target id of each
    entry: the argmax when ``argmax`` (default: the request is greedy), else a sample under the
    request's rule from the distribution renormalised over the subset and spread over the target
    vocabulary (zero elsewhere), which the exact rejection rule needs. Returns the target id, that
    distribution (None for an argmax) and the token's probability (1.0 for an argmax unless
    ``need_prob``). Given the ``position`` the draft is for and the request's race keys, the
    sample is that position's race over the distribution (``sample/race.py``), which the target's
    verification needs no distribution for (None is returned). ``params``: the sampling rule to
    draft by, if not the request's (a drafter's own temperature)."""
    params = seq.params if params is None else params
    if params.greedy if argmax is None else argmax:
        choice = int(logits.argmax())
        p_token = float(torch.softmax(logits, -1)[choice]) if need_prob else 1.0
        return int(target_ids[choice]), None, p_token
    if position is not None and seq.keys is not None:
        # The race over the subset's columns: the tokens outside it have probability 0 and never
        # win, so this is the race over the whole vocabulary, at a quarter of its cost (no scatter
        # into a vocabulary-wide row: 0.7 against 2.6 ms a draft for 65536 of 151,936 tokens, AMD EPYC Zen 3).
        probs = logits_to_probs(logits[None], params)[0]
        column = int(race(probs, seq.keys.at(position, vocab_size)[target_ids]))
        return int(target_ids[column]), None, float(probs[column])
    full = torch.full((vocab_size,), -torch.inf)
    full[target_ids] = logits
    probs = logits_to_probs(full[None], params)
    token = int(sample(probs, seq.generator)[0])
    return token, probs[0], float(probs[0, token])


def most_probable_tree(tokens: list[int], parents: list[int], scores: list[float], k: int) -> DraftProposal:
    """The ``k`` candidates of highest path log-probability ``scores`` as a tree proposal.

    Candidates are listed parents first (``parents[i]`` < i, -1 for the root's children). A
    child's path is never more probable than its parent's, and ties go to the earlier candidate,
    so the kept set holds every kept candidate's parent.
    """
    keep = sorted(sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:k])
    index = {node: j for j, node in enumerate(keep)}
    return DraftProposal(torch.tensor([tokens[i] for i in keep], dtype=torch.long), None,
                         tuple(-1 if parents[i] < 0 else index[parents[i]] for i in keep))


class Drafter(ABC):
    """Base of every drafter. The engine calls each hook at its moment, unconditionally; the
    defaults do nothing, so a drafter overrides only what it uses.

    ``adapts_length``: the speculation policy may choose ``k`` (False for a drafter whose
    proposal size is its own, like a lookahead window). ``draft_cost_prior``: a drafted token's
    cost as a share of a target step, which the policy assumes until it has measured the method
    (and always for seeded sampled requests): 0 for drafters that look tokens up. ``needs_hidden_states``:
    every target forward captures the states of ``hidden_layers`` (see ``HiddenCapture``) and
    the drafter gets them through ``observe_hidden`` (trained heads). ``stops_by_confidence``:
    its drafts come with their probabilities and it stops once their product falls below
    ``confidence``, which the policy sets each step (``set_confidence``; SpecDec++).
    ``shares_forwards``: its drafting is model calls that the step loop runs as one forward for
    every request drafting at once (``engine/drafting.py``), which the policy prices as shared.
    """

    name: ClassVar[str]
    adapts_length: ClassVar[bool] = True
    draft_cost_prior: ClassVar[float] = 0.0
    needs_hidden_states: ClassVar[bool] = False
    hidden_layers: tuple[int, ...] = ()
    stops_by_confidence: ClassVar[bool] = False
    shares_forwards: ClassVar[bool] = False
    confidence: float = 0.0  # the stop in force (``set_confidence``)
    _own_confidence: float | None = None  # the drafter's configured stop, once a step has set another

    def begin(self, seq: SequenceState) -> None:
        """A new request: index the prompt, prefill a draft model, reset state."""

    @abstractmethod
    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        """Up to ``k`` draft tokens continuing ``seq.token_ids``: the one hook every drafter defines
        (a drafter with a model defines it as ``run_alone(self.drafting(seq, k))``)."""

    def drafting(self, seq: SequenceState, k: int) -> Drafting:
        """``propose`` as a coroutine of model calls (see the module docstring), which the step
        loop runs together with other requests' calls. The default makes no calls."""
        return self.propose(seq, k)
        yield  # a generator function: the proposal is its return value

    def sources(self, seq: SequenceState) -> tuple[DraftSource, ...]:
        """The ways this drafter can draft the coming step (see ``DraftSource``), the one to
        prefer at equal merit first; the step loop asks just before drafting. The default: the
        drafter itself, at its cost prior, catch-up and confidence stop."""
        stop = self.set_confidence if self.stops_by_confidence else None
        return (DraftSource(self.name, self.draft_cost_prior, self.drafting, catch_up=self.catch_up(seq), stop=stop,
                            shared=self.shares_forwards),)

    def set_confidence(self, confidence: float | None) -> None:
        """Stop the coming drafts once the product of their probabilities falls below
        ``confidence`` (the last one is still proposed); None: the drafter's configured stop. The
        step loop sets it before each step's drafting, from what the speculation policy priced
        (``stops_by_confidence`` drafters read it), so no step's stop outlives its step."""
        if self._own_confidence is None:
            self._own_confidence = self.confidence
        self.confidence = self._own_confidence if confidence is None else confidence

    def observe(self, logits: Tensor) -> None:
        """The verify forward's logits [rows, V], before ``accept`` (drafters that learn from them)."""

    def observe_hidden(self, states: Tensor) -> None:
        """The target's hidden states [n, len(hidden_layers) * D] of the tokens committed since the
        last call, in order: after the prompt, every prompt token; after a verify step, the step's
        first token and its accepted drafts. So the states seen cover every committed token but
        the last, whose states the next verify forward computes (as the target's KV cache does).
        Called before ``begin`` finishes a prefill's work and before ``accept``."""

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        """The first ``n_accepted`` drafts were kept and one more token was appended to ``seq``."""

    def catch_up(self, seq: SequenceState) -> int:
        """Committed tokens this drafter must run through its own model before it can draft again,
        beyond the few a draft step feeds anyway: a prefill's worth after the prompt or a stretch
        of steps without drafts. The speculation policy weighs this before asking for drafts."""
        return 0

    def finish(self, seq: SequenceState) -> None:
        """The request ended (drafters that learn from whole requests)."""
