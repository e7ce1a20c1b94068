"""K by load: how many tokens to draft per request, given how many requests share a step.

On a CPU one verify forward over n requests costs about one pass over the weights while the rows
are few, then grows with the rows (n * (K + 1)) once the matmuls are compute-bound; drafting costs
K draft forwards per step. So speculation that pays for one request can cost more than it saves
for eight, the most common complaint about speculative serving. Two policies:

- ``KSchedule``: a fixed table, ``1-2:12,3-4:6,5-:0`` (the shape of vLLM's
  ``num_speculative_tokens_per_batch_size``): K = 12 for one or two running requests, 6 for three
  or four, none from five on. Running requests are those admitted, prompts still prefilling
  included, so the table turns K down as a wave arrives rather than one step after its prefill.
  A count the table does not name keeps the server's own K.
- ``AutoK``: picks, before every step, the K that maximizes the expected tokens per second of the
  step's requests, from what the server has measured: the verify forward's time by number of
  rows, a draft step's time by number of requests drafting, the acceptance rate of drafts, and
  the draft model's time per token when it catches up. It drafts only if that promises
  ``MIN_GAIN`` times plain steps' rate. With nothing measured yet it keeps the server's K. Row
  counts it has not measured are estimated optimistically (in proportion to rows below the
  least measured), so it moves toward fewer rows and measures them; and every
  ``EXPLORE_EVERY`` steps it tries the K next to its choice if that K's rows are not measured,
  a step that costs about what the chosen one does, so the choice settles on measured costs from
  either side.

Drafting again after steps without drafts (or for a request that never drafted) first feeds the
draft model every token it missed: a prompt's prefill on the draft. The draft model times those
forwards (``Drafter.pop_catch_up``); AutoK charges a catch-up once against the tokens the
requests may still make (``max_tokens`` left, at most ``HORIZON``), so a cheap-looking K that
needs one is taken only when the requests live long enough to repay it, and exploration never
pays one. Where speculation cannot pay, auto stays at K = 0 and the draft model does no work at
all: the server runs as plain decoding does, but for short probes that re-measure the acceptance,
ever rarer while drafting stays off (``PROBE_AFTER``), and only where drafts would pay if the
draft model guessed well. (Drafters that keep no model of their own catch up
nothing; a draft model of another vocabulary is not charged yet.)

K is only ever a cap on each request's own draft length (which still adapts to that request's
acceptance). Greedy output never depends on it; sampled output keeps exactly the target's
distribution, though a seeded request's draws follow its K, as they do with adaptive K.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdecode.params import MAX_SPECULATIVE_TOKENS
from specdecode.errors import InvalidConfigError

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d*)\s*)?:\s*(\d+)\s*$")
EMA = 0.2  # weight of a new step's times in the running estimates
ACCEPTANCE_EMA = 0.02  # weight of one request-step's drafts (many per step, each a noisy 0..K count)
EXPLORE_EVERY = 16  # steps between tries of a neighbouring K whose rows are not measured yet
HORIZON = 256  # most tokens a request is counted on to make: max_tokens bounds it, EOS often comes sooner
# Drafting must promise this much more than plain steps: the cost model leaves out what a step
# spends beyond its forwards (sampling, bookkeeping, a draft's first forward over two tokens),
# and a speculating server must not serve slower than plain decoding.
MIN_GAIN = 1.1
# At K = 0 nothing measures acceptance, so one bad stretch (a burst of prompts the draft model
# guesses badly) would keep auto at 0 for good. After PROBE_AFTER steps at 0, if drafts would pay
# at an acceptance near 1, it drafts PROBE_K for PROBE_SAMPLES request-steps (at most
# PROBE_STEPS steps, and only while each step's load would repay drafts near 1) and takes their
# acceptance as its new estimate if they were at least PROBE_MIN_SAMPLES; each probe that does
# not bring drafting back doubles the wait, up to PROBE_AFTER_MAX, so on a machine where
# drafting does not pay the probes cost ever less.
PROBE_AFTER = 256
PROBE_AFTER_MAX = 16384
PROBE_K = 2
PROBE_SAMPLES = 32
PROBE_MIN_SAMPLES = 8
PROBE_STEPS = 64
PROBE_ACCEPTANCE = 0.99  # "near 1": the acceptance at which a probe is worth its cost


@dataclass(frozen=True, slots=True)
class StepLoad:
    """What a step's K is chosen for (the scheduler fills it before drafting).

    ``decoding``: requests in this step's verify forward. ``admitted``: those plus the prompts
    still prefilling, the running count a table reads. ``catch_up``: tokens the requests' drafters
    must feed before they can draft (``Drafter.catch_up``), spread over ``catching_up`` requests.
    ``remaining``: tokens each decoding request may still make, on average (``max_tokens`` left,
    at most ``HORIZON``).
    """

    decoding: int
    admitted: int = 0
    catch_up: int = 0
    catching_up: int = 0
    remaining: float = HORIZON

    @property
    def running(self) -> int:
        return max(self.admitted, self.decoding)


@dataclass(frozen=True, slots=True)
class KRange:
    start: int
    end: int | None  # inclusive; None: no upper end
    k: int

    def holds(self, running: int) -> bool:
        return self.start <= running and (self.end is None or running <= self.end)


@dataclass(frozen=True, slots=True)
class KSchedule:
    """A fixed K for each range of running requests."""

    ranges: tuple[KRange, ...]

    @classmethod
    def parse(cls, text: str) -> KSchedule:
        """``START-END:K`` items, comma-separated; ``N:K`` is one count, ``START-:K`` open-ended."""
        ranges = []
        for item in text.split(","):
            match = _RANGE.match(item)
            if not match:
                raise InvalidConfigError(f"--k-by-load: cannot read {item.strip()!r}; write START-END:K items like "
                                         "1-2:12,3-4:6,5-:0, or 'auto'")
            start, end, k = int(match[1]), match[2], int(match[3])
            stop = start if end is None else (None if end == "" else int(end))
            if start < 1 or (stop is not None and stop < start):
                raise InvalidConfigError(f"--k-by-load: {item.strip()!r} is not a range of request counts >= 1")
            if k > MAX_SPECULATIVE_TOKENS:
                raise InvalidConfigError(f"--k-by-load: K is at most {MAX_SPECULATIVE_TOKENS}, got {k}")
            ranges.append(KRange(start, stop, k))
        ranges.sort(key=lambda r: r.start)
        for a, b in zip(ranges, ranges[1:]):
            if a.end is None or a.end >= b.start:
                raise InvalidConfigError(f"--k-by-load: ranges overlap at {b.start} requests")
        return cls(tuple(ranges))

    def k_for(self, load: StepLoad, k_max: int) -> int:
        return next((min(r.k, k_max) for r in self.ranges if r.holds(load.running)), k_max)

    def record_step(self, rows: int, forward_s: float, draft_steps: int = 0, draft_s: float = 0.0,
                    drafting: int = 0, catch_ups: Sequence[tuple[int, float]] = ()) -> None:
        """A fixed table learns nothing."""

    def record_drafts(self, accepted: int, rejected: int) -> None:
        """A fixed table learns nothing."""


@dataclass(slots=True)
class AutoK:
    """K from measured step costs; see the module docstring.

    Expected tokens per request of a step with K drafts at acceptance rate a (each draft kept with
    probability a, given the ones before it were): 1 + a + ... + a^K. Time of the step: K draft
    forwards (shared by the requests drafting together) plus the verify forward of
    decoding * (K + 1) rows, each estimated from the counts measured nearest to it; plus, once
    over the requests' remaining steps, the draft model's catch-up.
    """

    candidates: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 10, 12, 16, 24, 32)
    accepted: float | None = None  # running mean of drafts kept per request-step
    tried: float | None = None  # running mean of drafts decided per request-step (kept + refused)
    draft_step_s: dict[int, float] = field(default_factory=dict)  # one draft forward, by requests in it
    verify_s: dict[int, float] = field(default_factory=dict)  # forward time by rows
    catch_up_token_s: float | None = None  # a catch-up forward's time per token, beyond one draft step
    steps: int = 0
    idle_steps: int = 0  # steps at K = 0 in a row
    probe_after: int = PROBE_AFTER  # idle steps before the next probe
    probe: _Probe | None = None  # the probe under way

    @property
    def acceptance(self) -> float | None:
        """Drafts kept per draft decided: the chance a draft survives, given the ones before did."""
        if self.accepted is None or not self.tried:
            return None
        return min(self.accepted / self.tried, 0.999)

    def k_for(self, load: StepLoad, k_max: int) -> int:
        self.steps += 1
        acceptance = self.acceptance
        if acceptance is None or not self.draft_step_s or not self.verify_s:
            return k_max
        options = [c for c in self.candidates if c <= k_max]
        if self.probe is not None:
            if self.probe.steps < PROBE_STEPS and self._best(load, options, PROBE_ACCEPTANCE):
                self.probe.steps += 1
                return min(PROBE_K, k_max)
            self._end_probe()  # its steps are spent, or this load (a catch-up, say) would not repay drafts
            acceptance = self.acceptance
        best = self._best(load, options, acceptance)
        if self.steps % EXPLORE_EVERY == 0:
            for i in (best - 1, best + 1):
                if (0 <= i < len(options) and load.decoding * (options[i] + 1) not in self.verify_s
                        and (options[i] == 0 or not load.catch_up)):
                    return options[i]
        if best:
            self.idle_steps, self.probe_after = 0, PROBE_AFTER
            return options[best]
        self.idle_steps += 1
        if self.idle_steps > self.probe_after and self._best(load, options, PROBE_ACCEPTANCE):
            self.idle_steps, self.probe_after = 0, min(2 * self.probe_after, PROBE_AFTER_MAX)
            self.probe = _Probe(steps=1)
            return min(PROBE_K, k_max)
        return 0

    def _best(self, load: StepLoad, options: list[int], acceptance: float) -> int:
        """Index in ``options`` (``options[0]`` is K = 0) of the K with the best expected rate,
        0 unless it promises ``MIN_GAIN`` times plain steps' rate."""
        rates = [self._rate(load, k, acceptance) for k in options]
        best = max(range(len(options)), key=lambda i: (rates[i], -i))  # ties: the smaller K
        return best if rates[best] >= MIN_GAIN * rates[0] else 0

    def _rate(self, load: StepLoad, k: int, acceptance: float) -> float:
        """Expected tokens per second of ``load``'s requests drafting ``k`` each, a catch-up
        spread over the steps they have left."""
        n = load.decoding
        per_request = sum(acceptance**i for i in range(k + 1))
        step_s = k * self.draft_time(n) + self.verify_time(n * (k + 1))
        if k and load.catch_up:
            steps = max(load.remaining / per_request, 1.0)
            step_s += self.catch_up_time(load) / steps
        return n * per_request / max(step_s, 1e-9)

    def catch_up_time(self, load: StepLoad) -> float:
        """``load``'s catch-up: a forward of its own per request (about one draft step) plus the
        time per token; a cost not measured yet counts as none, so the first one is paid and timed."""
        return load.catching_up * self.draft_time(1) + load.catch_up * (self.catch_up_token_s or 0.0)

    def verify_time(self, rows: int) -> float:
        """Interpolated between the two measured row counts around ``rows``; outside them, in
        proportion to rows from the nearest (optimistic below the least: see the module docstring)."""
        return _estimate(self.verify_s, rows, proportional=True)

    def draft_time(self, requests: int) -> float:
        """One draft forward for ``requests`` drafting together: interpolated, and outside the
        measured counts the nearest one's time (a small draft's forward reads its weights once,
        whatever the few rows)."""
        return _estimate(self.draft_step_s, requests, proportional=False) if self.draft_step_s else 0.0

    def record_step(self, rows: int, forward_s: float, draft_steps: int = 0, draft_s: float = 0.0,
                    drafting: int = 0, catch_ups: Sequence[tuple[int, float]] = ()) -> None:
        """One step: its verify forward (``rows`` rows), and ``drafting`` requests' drafting,
        ``draft_steps`` forwards deep, in ``draft_s``, with the catch-up forwards it ran first,
        each (tokens, seconds) as the draft model timed it. A catch-up's forward also yields its
        request's first draft, so one draft step's time comes off before dividing by tokens."""
        self.verify_s[rows] = _ema(self.verify_s.get(rows), forward_s)
        for tokens, seconds in catch_ups:
            self.catch_up_token_s = _ema(self.catch_up_token_s, max(seconds - self.draft_time(1), 0.0) / tokens)
        if draft_steps and drafting and not catch_ups:  # a step with a catch-up in it says little of a draft step
            self.draft_step_s[drafting] = _ema(self.draft_step_s.get(drafting), draft_s / draft_steps)

    def record_drafts(self, accepted: int, rejected: int) -> None:
        """One request's step: ``accepted`` drafts kept, ``rejected`` (0 or 1) refused; the first
        refused draft ends the step, so the rate is per draft given the ones before were kept.
        During a probe the steps are summed apart, to replace the stale estimate at its end."""
        if not accepted + rejected:
            return
        if self.probe is not None:
            self.probe.accepted += accepted
            self.probe.tried += accepted + rejected
            self.probe.samples += 1
            if self.probe.samples >= PROBE_SAMPLES:
                self._end_probe()
            return
        self.accepted = _ema(self.accepted, accepted, ACCEPTANCE_EMA)
        self.tried = _ema(self.tried, accepted + rejected, ACCEPTANCE_EMA)

    def _end_probe(self) -> None:
        """The probe's acceptance becomes the estimate, if it saw enough drafts to say
        (``PROBE_MIN_SAMPLES``: one or two request-steps would swing it to 0 or 1)."""
        probe, self.probe = self.probe, None
        if probe is not None and probe.samples >= PROBE_MIN_SAMPLES:
            self.accepted, self.tried = probe.accepted / probe.samples, probe.tried / probe.samples


@dataclass(slots=True)
class _Probe:
    """Drafts summed over a probe's request-steps."""

    steps: int = 0
    samples: int = 0
    accepted: int = 0
    tried: int = 0


def _estimate(measured: dict[int, float], x: int, proportional: bool) -> float:
    """``measured`` (by count) at ``x``: interpolated between the two counts around it; outside
    them, the nearest count's value, scaled in proportion to the count if ``proportional``."""
    known = sorted(measured)
    i = bisect.bisect_left(known, x)
    if i < len(known) and known[i] == x:
        return measured[x]
    if i in (0, len(known)):
        edge = known[0] if i == 0 else known[-1]
        return measured[edge] * x / edge if proportional else measured[edge]
    lo, hi = known[i - 1], known[i]
    return measured[lo] + (measured[hi] - measured[lo]) * (x - lo) / (hi - lo)


def _ema(old: float | None, new: float, weight: float = EMA) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def parse_k_by_load(text: str | None) -> KSchedule | AutoK | None:
    """``--k-by-load``: None (off), ``auto``, or a table."""
    if text is None or not text.strip():
        return None
    if text.strip() == "auto":
        return AutoK()
    return KSchedule.parse(text)
