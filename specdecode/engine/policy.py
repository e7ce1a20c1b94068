"""How far each request drafts at each step: the speculation policy.

One policy object decides for every path (``LLM.generate``, ``stream`` and ``chat``, the CLI, the
bench, the server): before each step the step loop (``engine/batch.py``) asks it for every
decoding request's draft length, 0 included (a plain step), and after the step tells it what the
step cost. Exactness never depends on the choice; only speed does.

``CostModel`` (the default) maximises the expected tokens per second of the step's requests from
costs measured while running (``costs.py``): the verify forward's time by total rows, each
method's seconds per drafted token, a draft model's catch-up, and each request's acceptance (the
chance that a draft survives given that the ones before it did). A request's j-th draft adds
a^j expected tokens and costs its draft time plus one verify row. Drafts are added one at a
time, best gain per second first, while each adds more tokens per second than the step makes
at its current rate: so a request drafts nothing when not even its first draft repays itself (a
plain step), and a step of many requests, whose extra rows cost integer compute, drafts less.
A request's acceptance starts from its method's (a draft model's no lower than its prior, so that
each of its requests drafts and is measured) and moves with each draft decided (``DRAFT_EMA``).
A drafter that knows its confidence (``Drafter.stops_by_confidence``) may reach further than the
request's average acceptance would draft and stops where the product of its
probabilities says a further draft no longer repays itself (``confidence_stops``, SpecDec++);
planned at K = 0, it still drafts where its recent drafting steps paid (``runs_pay``).
A drafter may offer several sources for a step (``Drafter.sources``: ``combined`` offers a free
copy from a context match and its draft model); ``pick_sources`` takes, per request, the one with
the best expected rate, and acceptance and cost are learned per source name. A request at K = 0
measures nothing, so after ``PROBE_AFTER`` such steps it drafts ``PROBE_K``
once to re-measure (the wait doubles while drafting stays off), paying its drafter's catch-up on
the tokens it missed when that is cheap beside the request's remaining time
(``PROBE_CATCH_UP_SHARE``), and only in a step where a draft could pay at a sure drafter's
acceptance: in a busy step every request waits for a probe's catch-up and rows. A drafted
token costs what it costs a request drafting alone (``drafting.py`` records a share of a shared
forward as the lone forward it stands for), a draft model's forwards, which a step's requests
share, cost one per depth for all the requests drafting that deep (``costs.shared_forward``),
and a confident drafter's reach is priced in the step as planned. No output depends on the
choice: greedy tokens are argmaxes and sampled ones win races keyed by their position
(``sample/race.py``), so every request, seeded or not, is planned on measured costs.

``FixedK`` drafts ``num_speculative_tokens`` every step (``adaptive=False``: for experiments).
Drafters that size their own proposals (``adapts_length = False``, a lookahead window) always
get their K. A server's ``--k-by-load`` table caps whichever policy runs.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdecode.engine.costs import (DRAFT_REQUEST_SHARE, PROBE_AFTER, REFERENCE_COSTS, Costs, RequestSpeculation, StepCosts,
                                     StepTimes, shared_forward)

PROBE_AFTER_MAX = 1024
PROBE_K = 2
PROBE_CATCH_UP_SHARE = 0.1  # most a probe's catch-up may cost, as a share of the request's plain time left
# A draft must promise this much more than the step's current rate: the model leaves out what a
# step spends beyond its forwards (sampling each row, bookkeeping).
MARGIN = 1.05
# How sure a confident drafter's run may be taken to be when sizing the most it may draft: its
# own probabilities then stop it where it grows unsure (``CostModel.confidence_stops``). The int4
# 0.5B draft's tokens of probability >= 0.9 agree with the target's greedy ones 98.7% of the time
# (1,332 of 2,193 positions of the 21 bench answers; ``scripts/policy_sim.py --calibration``, AMD
# EPYC Zen 3, 2026-11-28); replayed at this machine's costs, a reach sized at 0.99 against 0.95
# makes the bench's categories 1.180x against 1.169x (the same script).
CONFIDENT_ACCEPTANCE = 0.99
# How likely a confident drafter's next draft survives once its run so far is sure, until the
# request's own drafts after a kept one measure it (``RequestSpeculation.continuation``): after a
# kept token it gave probability >= 0.7, the int4 draft's next token agrees 88.1% of the time
# (1,542 positions; the same script, same answers). A request's mean acceptance prices its first
# draft, often a coin toss; taken for the next one in a sure run, it raised the stop as the mean
# fell and cut the runs to one draft.
CONTINUATION_ACCEPTANCE = 0.88
# Acceptance a method starts from before any of its drafts were verified, unless its source
# brings its own (``DraftSource.acceptance_prior``): optimistic, so a new method drafts and gets
# measured; its requests' measured rates replace it within a few steps.
PRIOR_ACCEPTANCE = 0.8
# Weight of one decided draft in its request's acceptance, which starts from its method's: one
# refused first draft moves 0.85 to 0.72, so it takes a run of refusals, not one unlucky step,
# to turn a request's drafting off, and a probe's two kept drafts count for more than one.
DRAFT_EMA = 0.15
# Weight of one drafting step in a request's means of drafts proposed and kept per such step
# (``CostModel.runs_pay``): a plain mean over its first twenty, then a running mean over about as
# many, so that neither its first step nor a few hard positions decide alone.
RUN_EMA = 0.05
# Weight of one decided draft in its method's acceptance, which starts from its prior: one
# request's first step, all refused, moves it a little, not to 0 (new requests start there).
METHOD_EMA = 0.05


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One decoding request as the policy sees it before a step.

    ``method``: its drafter's name; ``k_max``: its most drafts per step; ``room``: the most this
    step allows (``max_tokens`` and the context); ``adaptive``: the policy chooses its K (else
    ``k_max``); ``catch_up``: tokens its drafter must feed its own model before drafting;
    ``remaining``: tokens the request may still make; ``state``: what the policy learned of it.
    """

    method: str
    k_max: int
    room: int
    adaptive: bool = True
    catch_up: int = 0
    remaining: int = 256
    state: RequestSpeculation = field(default_factory=RequestSpeculation)
    draft_cost_prior: float = 0.0  # a drafted token's cost as a share of a step, until measured
    confident: bool = False  # its drafter stops by its own confidence, at a threshold the policy sets
    acceptance_prior: float | None = None  # its method's acceptance until measured (None: PRIOR_ACCEPTANCE)
    shared: bool = False  # its drafts join the step's other requests of its method in one forward per depth

    @property
    def limit(self) -> int:
        return max(0, min(self.k_max, self.room))


class SpeculationPolicy(ABC):
    """Chooses each request's draft length for a step and learns from what steps cost."""

    @abstractmethod
    def choose(self, requests: Sequence[DraftRequest]) -> list[int]:
        """Each request's draft length for the coming step (0: a plain step for it)."""

    def draft_lengths(self, requests: Sequence[DraftRequest], running: int | None = None,
                      cap: Callable[[int], int | None] | None = None) -> list[int]:
        """Each request's draft length: ``plan`` without the confidence stops."""
        return [k for k, _ in self.plan(requests, running, cap)]

    def plan(self, requests: Sequence[DraftRequest], running: int | None = None,
             cap: Callable[[int], int | None] | None = None) -> list[tuple[int, float | None]]:
        """``choose`` and ``confidence_stops``, within each request's room and ``cap``'s limit for
        ``running`` requests (default: those given): each request's draft length and stop."""
        cap = None if cap is None else cap(len(requests) if running is None else running)
        capped = [r if cap is None else _with_limit(r, min(r.limit, cap)) for r in requests]
        ks = [min(k, r.limit) for k, r in zip(self.choose(capped), capped)]
        return [(min(k, r.limit), stop) for (k, stop), r in zip(self.confidence_stops(capped, ks), capped)]

    def pick_sources(self, options: Sequence[Sequence[DraftRequest]]) -> list[int]:
        """For each request, which of its draft sources (``Drafter.sources``, one ``DraftRequest``
        each) drafts this step, as an index into its options. The default: the first."""
        return [0] * len(options)

    def confidence_stops(self, requests: Sequence[DraftRequest], ks: Sequence[int]) -> list[tuple[int, float | None]]:
        """For requests about to draft ``ks``: each one's draft length and, for a ``confident``
        request, the probability below which its drafting stops (None: its drafter's own
        setting). The default changes nothing."""
        return [(k, None) for k in ks]

    def record(self, step: StepTimes) -> None:
        """A step's measured costs and outcomes (policies that learn override this)."""


class FixedK(SpeculationPolicy):
    """Every request drafts as many as it may, every step."""

    def choose(self, requests: Sequence[DraftRequest]) -> list[int]:
        return [r.limit for r in requests]


class CostModel(SpeculationPolicy):
    """Draft lengths that maximise expected tokens per second (see the module docstring)."""

    def __init__(self, costs: StepCosts | None = None) -> None:
        self.costs = costs or StepCosts()
        self.method_acceptance: dict[str, float] = {}
        self.method_prior: dict[str, float] = {}  # the priors methods' requests brought, until measured

    def acceptance(self, r: DraftRequest) -> float:
        """The request's measured acceptance; at its first plan, its method's over earlier
        requests, and for a drafter that costs time (a model's) no lower than the
        method's prior. Such a request drafts at its start so that its own acceptance gets
        measured: requests of one draft model differ more than its mean says (the 0.5B draft
        agrees with the target on 84% of a summary's tokens and 66% of a chat answer's,
        `scripts/draft_agreement.py`), and one that starts below the break-even would never draft,
        so never learn otherwise (`scripts/policy_sim.py`). A free copy's bet is set by its match
        (its source's name), so its method's rate stands for each new request."""
        if r.acceptance_prior is not None:
            self.method_prior.setdefault(r.method, r.acceptance_prior)
        if r.state.acceptance is None:  # its first plan: where it starts
            r.state.acceptance = self._start(r)
        return _clamp(r.state.acceptance)

    def _start(self, r: DraftRequest) -> float:
        """Where a request of ``r``'s method starts (see ``acceptance``)."""
        method = self._method(r.method)
        return max(method, self._prior(r.method)) if r.draft_cost_prior > 0 else method

    def _prior(self, method: str) -> float:
        return self.method_prior.get(method, PRIOR_ACCEPTANCE)

    def _method(self, method: str) -> float:
        return self.method_acceptance.get(method, self._prior(method))

    def choose(self, requests: Sequence[DraftRequest]) -> list[int]:
        if not self.costs.verify_measured:  # nothing measured yet: draft a little and measure
            return [r.limit if not r.adaptive else min(r.limit, PROBE_K) for r in requests]
        ks = _allocate(requests, self.costs, self.acceptance)
        for i in range(len(requests)):
            if not ks[i] and self.runs_pay(requests, ks, i):
                ks[i] = 1  # its confidence then sets how far (``confidence_stops``)
        return [self._probe(requests, ks, i) for i in range(len(requests))]

    def runs_pay(self, requests: Sequence[DraftRequest], ks: Sequence[int], i: int) -> bool:
        """Whether confident request ``i``, planned at K = 0, drafts after all: its drafting steps,
        each stopped by its own probabilities, kept ``run_kept`` drafts of ``run_drafted`` on
        average, and at this step's costs that adds more tokens per second than the step makes.
        The acceptance behind K = 0 prices each draft as if it were proposed blind; a confident
        drafter stops itself where it grows unsure, so its runs can pay where its first draft is
        a coin toss. A plain step also leaves its draft model behind, to catch up when it drafts
        again. Replayed at this machine's costs (``scripts/policy_sim.py``, AMD EPYC Zen 3,
        2026-11-28: a step 61 ms, a row 0.19 of it, a drafted token 15 ms) with the stop's
        continuation: ``draft_model`` 1.190x plain over the bench's prompts against 1.180x, chat
        1.061x against 1.025x; at a row of 0.12 of a step 1.268x against 1.259x; where a draft
        token costs 0.42 of a step and drafting does not pay, 0.987x against 0.984x (drafting
        every step there: 0.966x). Requests turned on earlier in the same step count as one draft
        each in the step's rows, a first-order view of a batch."""
        r = requests[i]
        state = r.state
        if not (r.confident and r.adaptive and r.limit and state.run_drafted and state.run_kept is not None):
            return False
        costs, acceptance = self._basis()
        rows, tokens, seconds = _planned(requests, ks, costs, acceptance)
        short = min(1.0, r.limit / state.run_drafted)  # a cap or the room cuts its runs short
        drafted, kept = state.run_drafted * short, state.run_kept * short
        row = costs.verify(rows + 1) - costs.verify(rows)
        cost = drafted * (row + costs.draft_token(r))
        if r.catch_up:
            cost += _catch_up(costs, r) / max(r.remaining / (1 + kept), 1.0)
        return kept * seconds > MARGIN * tokens * cost

    def pick_sources(self, options: Sequence[Sequence[DraftRequest]]) -> list[int]:
        """The source with the best expected tokens per second drafting alone at its best K
        (a first-order choice: in a batch, the other requests' rows change K, rarely the winner).
        Ties go to the earlier source."""
        picks = []
        for opts in options:
            if len(opts) == 1:  # most drafters: nothing to weigh
                picks.append(0)
                continue
            rates = [self._solo_rate(r) for r in opts]
            picks.append(max(range(len(opts)), key=lambda i: (rates[i], -i)))
        return picks

    def confidence_stops(self, requests: Sequence[DraftRequest], ks: Sequence[int]) -> list[tuple[int, float | None]]:
        """SpecDec++'s stop, priced by the cost model: a confident request may draft as far as a
        run its drafter is sure of would pay (K chosen at ``CONFIDENT_ACCEPTANCE``), and stops
        once the chance that its drafts so far all survive, times the chance the next one does
        (its acceptance, but no lower than its continuation: ``CONTINUATION_ACCEPTANCE`` until
        measured), no longer repays a further draft at the step's rate:
        ``product < MARGIN * rate * cost / next``. Others keep their K."""
        costs, acceptance = self._basis()
        rows, tokens, seconds = _planned(requests, ks, costs, acceptance)
        sure = {}  # a confident request's reach: its K were it as sure as CONFIDENT_ACCEPTANCE
        for i, r in enumerate(requests):
            if r.confident and r.adaptive and ks[i]:
                sure[i] = self._k_among(requests, ks, i, max(acceptance(r), CONFIDENT_ACCEPTANCE))
        row_cost = costs.verify(rows + 1) - costs.verify(rows)
        plans: list[tuple[int, float | None]] = []
        for i, (r, k) in enumerate(zip(requests, ks)):
            if i not in sure:
                plans.append((k, None))
                continue
            cost = costs.draft_token(r) + row_cost
            next_kept = max(acceptance(r), CONTINUATION_ACCEPTANCE if r.state.continuation is None else r.state.continuation)
            threshold = MARGIN * tokens / seconds * cost / next_kept if seconds > 0 else 0.0
            plans.append((max(k, sure[i]), min(threshold, 0.99)))
        return plans

    def _k_among(self, requests: Sequence[DraftRequest], ks: Sequence[int], i: int, acceptance_i: float) -> int:
        """Request ``i``'s draft length were its acceptance ``acceptance_i``, in this step as
        planned: every other request's drafts fixed at ``ks``, their rows and tokens counted."""
        costs, acceptance = self._basis()
        hopeful = dataclasses.replace(requests[i], state=RequestSpeculation(acceptance=acceptance_i))
        fixed = [hopeful if j == i else _with_limit(dataclasses.replace(r, adaptive=False), min(k, r.limit))
                 for j, (r, k) in enumerate(zip(requests, ks))]
        return _allocate(fixed, costs, lambda q: _clamp(acceptance_i) if q is hopeful else acceptance(q))[i]

    def _basis(self) -> tuple[Costs, Callable[[DraftRequest], float]]:
        """The costs and acceptance requests are planned on: measured ones, or before anything
        is measured, reference costs."""
        return (self.costs if self.costs.verify_measured else REFERENCE_COSTS), self.acceptance

    def _solo_rate(self, r: DraftRequest) -> float:
        costs, acceptance = self._basis()
        [k] = _allocate([r], costs, acceptance)
        tokens = _expected(acceptance(r), k)
        seconds = costs.verify(1 + k) + k * costs.draft_token(r)
        if k and r.catch_up:
            seconds += _catch_up(costs, r) / max(r.remaining / tokens, 1.0)
        return tokens / seconds if seconds > 0 else tokens

    def _probe(self, requests: Sequence[DraftRequest], ks: Sequence[int], i: int) -> int:
        """Request ``i``'s ``ks[i]``, or ``PROBE_K`` when its drafting has been off long enough to
        re-measure and a measurement could change the choice: were its acceptance as high as a
        sure drafter's (``CONFIDENT_ACCEPTANCE``), it would draft in this step as planned. In a
        step whose other rows already make a draft dearer than any acceptance repays (many
        requests on a compute-bound target), a probe would pay its drafts, rows and catch-up
        for nothing, so none is run until one could."""
        r, k = requests[i], ks[i]
        state = r.state
        if not r.adaptive or r.limit == 0:
            return k
        if k:
            state.idle, state.probe_after = 0, PROBE_AFTER
            return k
        state.idle += 1
        if (state.idle < state.probe_after or not self._probe_affordable(r)
                or not self._k_among(requests, ks, i, CONFIDENT_ACCEPTANCE)):
            return 0
        state.idle, state.probe_after = 0, min(2 * state.probe_after, PROBE_AFTER_MAX)
        return min(PROBE_K, r.limit)

    def _probe_affordable(self, r: DraftRequest) -> bool:
        """Whether a probe's catch-up (a draft model's prefill of the tokens it missed) costs at
        most ``PROBE_CATCH_UP_SHARE`` of the request's remaining tokens decoded plainly: a probe
        that finds drafting still does not pay loses what it spent."""
        costs, _ = self._basis()
        return _catch_up(costs, r) <= PROBE_CATCH_UP_SHARE * r.remaining * costs.verify(1)

    def record(self, step: StepTimes) -> None:
        self.costs.record(step)
        for outcome in step.requests:
            if not outcome.decided:
                continue
            rate = outcome.accepted / outcome.decided
            state = outcome.state
            if outcome.drafted:  # a plain mean over its first steps, then a running one
                state.run_steps += 1
                weight = max(RUN_EMA, 1 / state.run_steps)
                state.run_drafted = _ema(state.run_drafted, outcome.drafted, weight)
                state.run_kept = _ema(state.run_kept, outcome.accepted, weight)
            if outcome.accepted and outcome.decided > 1:  # drafts decided after a kept one
                deeper = outcome.decided - 1
                before = CONTINUATION_ACCEPTANCE if state.continuation is None else state.continuation
                state.continuation = before + (1 - (1 - DRAFT_EMA) ** deeper) * ((outcome.accepted - 1) / deeper - before)
            start = state.acceptance
            if start is None:  # never planned (a fixed K): its method's
                start = self._method(outcome.method)
            weight = 1 - (1 - DRAFT_EMA) ** outcome.decided
            state.acceptance = start + weight * (rate - start)
            method = self._method(outcome.method)  # its prior until measured
            weight = 1 - (1 - METHOD_EMA) ** outcome.decided
            self.method_acceptance[outcome.method] = method + weight * (rate - method)


def _allocate(requests: Sequence[DraftRequest], costs: Costs, acceptance: Callable[[DraftRequest], float]) -> list[int]:
    """Draft lengths for ``requests`` verified together: drafts added a move at a time, best
    expected tokens per second first, while each move adds more than the step makes at its
    current rate. A move is one request's next draft, or, for a model whose forwards the step's
    requests share (``DraftRequest.shared``), the next depth for several of its requests at once:
    a depth that no request drafts yet costs a lone forward for the first and
    ``DRAFT_REQUEST_SHARE`` of one for each other (``shared_forward``), so two requests that pay
    only together start it together. A drafted token's cost is what it costs a request drafting
    alone (``costs.py``)."""
    ks = [r.limit if not r.adaptive else 0 for r in requests]
    rows, tokens, seconds = _planned(requests, ks, costs, acceptance)
    while True:
        move, gain, cost = _best_move(requests, ks, rows, costs, acceptance)
        if not move or gain * seconds <= MARGIN * tokens * cost:
            return ks
        for i in move:
            ks[i] += 1
        rows += len(move)
        tokens += gain
        seconds += cost


def _best_move(requests: Sequence[DraftRequest], ks: Sequence[int], rows: int, costs: Costs,
               acceptance: Callable[[DraftRequest], float]) -> tuple[list[int], float, float]:
    """The move (requests whose K grows by one) of best expected tokens per second, its expected
    tokens and its seconds; an empty move when no request may draft more. Ties go to single
    requests, then to the earlier one."""
    best: list[int] = []
    best_gain, best_cost = 0.0, 1.0

    def consider(move: list[int], gain: float, cost: float) -> None:
        nonlocal best, best_gain, best_cost
        if not best or gain * best_cost > best_gain * cost:
            best, best_gain, best_cost = move, gain, cost

    def first_draft(i: int, gain: float) -> float:  # a catch-up, spread over the steps left
        r = requests[i]
        return _catch_up(costs, r) / max(r.remaining / (1 + gain), 1.0) if ks[i] == 0 and r.catch_up else 0.0

    def open_to(i: int) -> bool:
        return requests[i].adaptive and ks[i] < requests[i].limit

    row = costs.verify(rows + 1) - costs.verify(rows)  # the linear verify cost: each row alike

    deepest: dict[str, int] = defaultdict(int)  # per shared model: the deepest draft planned
    for r, k in zip(requests, ks):
        if r.shared:
            deepest[r.method] = max(deepest[r.method], k)
    for i, r in enumerate(requests):
        if not open_to(i):
            continue
        gain = acceptance(r) ** (ks[i] + 1)
        joins = r.shared and deepest[r.method] > ks[i]  # another request's forward at that depth
        draft = costs.draft_token(r) * (DRAFT_REQUEST_SHARE if joins else 1.0)
        consider([i], gain, draft + row + first_draft(i, gain))
    for method, depth in deepest.items():  # a new depth for several requests at once
        level = sorted((i for i, r in enumerate(requests) if r.shared and r.method == method and ks[i] == depth
                        and open_to(i)), key=lambda i: -acceptance(requests[i]))
        gain = catch_ups = 0.0
        for size, i in enumerate(level, 1):
            g = acceptance(requests[i]) ** (depth + 1)
            gain += g
            catch_ups += first_draft(i, g)
            if size > 1:
                draft = costs.draft_token(requests[i]) * shared_forward(size)
                consider(level[:size], gain, draft + size * row + catch_ups)
    return best, best_gain, best_cost


def _planned(requests: Sequence[DraftRequest], ks: Sequence[int], costs: Costs,
             acceptance: Callable[[DraftRequest], float]) -> tuple[int, float, float]:
    """A step in which request i drafts ``ks[i]``: its verify rows, expected tokens and seconds."""
    rows = len(requests) + sum(ks)
    tokens = sum(_expected(acceptance(r), k) for r, k in zip(requests, ks))
    return rows, tokens, costs.verify(rows) + _draft_seconds(requests, ks, costs)


def _draft_seconds(requests: Sequence[DraftRequest], ks: Sequence[int], costs: Costs) -> float:
    """Drafting seconds of a step in which request i drafts ``ks[i]``: a request's drafted tokens
    at their cost alone, and those of shared models' requests as one forward per depth for all
    of a method's requests drafting that deep (``shared_forward``)."""
    total = 0.0
    depths: dict[str, list[int]] = defaultdict(list)
    unit: dict[str, float] = {}
    for r, k in zip(requests, ks):
        if r.shared:
            depths[r.method].append(k)
            unit[r.method] = costs.draft_token(r)
        else:
            total += costs.draft_token(r) * k
    for method, kk in depths.items():
        total += unit[method] * sum(shared_forward(sum(k >= j for k in kk)) for j in range(1, max(kk) + 1))
    return total


def _catch_up(costs: Costs, r: DraftRequest) -> float:
    """Seconds of ``r``'s catch-up: as measured, but never more than feeding its tokens one
    forward each would cost (its drafted tokens' cost), a bound that keeps one catch-up slowed by
    another process from shutting its draft model out for good."""
    return min(costs.catch_up(r.catch_up), r.catch_up * costs.draft_token(r)) if r.catch_up else 0.0


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


def _clamp(acceptance: float) -> float:
    return min(max(acceptance, 0.0), 0.995)


def _expected(acceptance: float, k: int) -> float:
    """Expected tokens of a step with ``k`` drafts: 1 + a + ... + a^k."""
    return sum(acceptance**j for j in range(k + 1))


def _with_limit(r: DraftRequest, limit: int) -> DraftRequest:
    return dataclasses.replace(r, k_max=limit)
