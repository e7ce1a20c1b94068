"""What steps cost on this machine and model, measured while running.

The speculation policy (``policy.py``) weighs drafts against these. A verify forward's time grows
with its rows once the matmuls turn compute-bound (on a 2-core CPU each extra row of a quantized
target costs a share of a whole step): ``level * (1 + share * (rows - 1))``. The level is the
one-row step's seconds now, which every step updates whatever its rows; the share is learned
slowly, and only from two consecutive steps of different row counts: their ratio of times,
which a spell of load (another process on a 2-core machine, a shared host's slow vCPU) leaves
alone because it slows both. A step alone cannot tell a slower machine from dearer rows: learned
from each step against the level, a share measured high in a slow spell would hold the policy
at the row count it then picks, whose steps would confirm the share through the level they set,
down to plain steps for good (tests/test_policy.py has such spells). Drafting is
kept per method as the cost of a drafted token to a request drafting alone, and a draft model's
catch-up (feeding tokens it missed, a prefill) by its size, both in one-row steps too, so load
moves the level alone. The requests of a step that draft with one model share its forwards (one
per draft depth, ``drafting.py``), which cost ``shared_forward(m)`` lone forwards for m
requests: a request's share of such a forward is recorded as the lone forward it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

EMA = 0.2  # weight of a new measurement in its running mean
SHARE_EMA = 0.1  # the same for a pair of steps' row share: one pair is noisy (a few % of a step each)
# Most a pair's share may differ from the estimate in the running mean (so a pair moves it by at
# most SHARE_EMA * SHARE_CLIP): the pairs' shares are skewed (never below 0, up to MAX_SHARE when
# the load changed between the two steps), so their plain running mean sat above their median
# (0.24 against 0.21 over the 494 pairs of a bench run's step trace, AVX2); clipped, it tracks the
# median, at half the spread.
SHARE_CLIP = 0.1
MAX_SHARE = 1.0  # most a pair may say an extra row costs, in one-row steps (a whole step)
PROBE_AFTER = 16  # steps at K = 0 before a request re-measures its acceptance (policy.py)
# What each further request adds to a draft-model forward shared by a step's requests, in lone
# forwards: one int4 draft step of 2 / 4 / 8 requests took 0.97 / 1.52 / 2.70 of one request's
# (`python scripts/draft_step.py --quantize int4 --requests 1,2,4,8`, AMD EPYC Zen 3, AVX2, 2026-11-28): its
# weights stream once for all of them, and from a few rows on its rows cost integer compute.
DRAFT_REQUEST_SHARE = 0.2
# Where the row share starts: the quantized target's extra rows cost about 0.2 of a one-row step
# on VNNI and 0.2-0.3 on AVX2 (`specdecode verify-cost`, docs/GGUF_NATIVE.md).
ROW_SHARE_PRIOR = 0.25


class DraftCostKey(Protocol):
    """What a draft's cost is looked up by (``policy.DraftRequest`` has it)."""

    method: str
    draft_cost_prior: float


class Costs(Protocol):
    """What the policy reads: a verify forward's, a drafted token's and a catch-up's cost."""

    def verify(self, rows: int) -> float: ...

    def draft_token(self, request: DraftCostKey) -> float: ...

    def catch_up(self, tokens: int) -> float: ...


@dataclass(slots=True)
class RequestSpeculation:
    """What the speculation policy learned about one request: its acceptance, its steps without
    drafts, and what its drafting steps proposed and kept."""

    acceptance: float | None = None  # per draft, given the ones before survived; None: not planned yet
    idle: int = 0  # steps in a row at K = 0
    probe_after: int = PROBE_AFTER
    run_steps: int = 0  # steps that drafted
    run_drafted: float | None = None  # drafts proposed in such a step (a running mean); None: none yet
    run_kept: float | None = None  # drafts kept in such a step
    continuation: float | None = None  # per draft after a kept one (None: not measured yet)


@dataclass(slots=True)
class RequestOutcome:
    """One request's part of a step: its method, drafts decided and kept, drafting time."""

    method: str
    state: RequestSpeculation
    drafted: int = 0  # positions drafted (a tree's depth)
    accepted: int = 0
    draft_s: float = 0.0  # this request's drafting time as if alone (``shared_forward``), catch-ups excluded

    @property
    def decided(self) -> int:
        """Drafts the acceptance rule decided on: the kept ones and the first refused one."""
        return self.accepted + int(self.accepted < self.drafted)


@dataclass(slots=True)
class StepTimes:
    """One step as measured: its verify rows and time, catch-ups run, and each request's part."""

    rows: int
    verify_s: float
    requests: list[RequestOutcome] = field(default_factory=list)
    catch_ups: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) per catch-up forward


@dataclass(slots=True)
class StepCosts:
    """Running estimates of the costs a step is made of (see the module docstring)."""

    step_s: float | None = None  # the level: a one-row verify forward's seconds now; None: not measured
    row_share: float = ROW_SHARE_PRIOR  # an extra verify row's cost in one-row steps
    draft_token_steps: dict[str, float] = field(default_factory=dict)  # by method, in one-row steps
    # catch-ups by size (the bit length of their token count): running means of (tokens, one-row steps)
    catch_up_by_size: dict[int, tuple[float, float]] = field(default_factory=dict)
    _last: tuple[int, float] | None = field(default=None, repr=False)  # the last step's (rows, seconds)

    @property
    def verify_measured(self) -> bool:
        return self.step_s is not None

    def verify(self, rows: int) -> float:
        """Seconds of a verify forward over ``rows`` rows (0.0 before any was measured)."""
        return 0.0 if self.step_s is None else self.step_s * self.steps(rows)

    def steps(self, rows: int) -> float:
        """A verify forward over ``rows`` rows in one-row steps."""
        return 1.0 + self.row_share * max(rows - 1, 0)

    def draft_token(self, request: DraftCostKey) -> float:
        """Seconds per drafted token of the request's method, drafting alone: its measured share
        of a one-row step (until measured, its drafter's prior) times that step."""
        return self.draft_token_steps.get(request.method, request.draft_cost_prior) * self.verify(1)

    def catch_up(self, tokens: int) -> float:
        """Seconds to feed ``tokens`` through a draft model: a line through the catch-up sizes
        measured (a forward's fixed cost plus a cost per token, which a prompt's prefill and a
        few missed tokens both pin down). From one size alone it never scales up, only down: a
        catch-up judged dearer than it is would never run, so never be measured again."""
        points = sorted(self.catch_up_by_size.values())
        if not points:
            return 0.0
        if len(points) == 1:
            n, steps = points[0]
            return steps * min(tokens / n, 1.0) * self.verify(1)
        a, b = _fit(points)
        return max(a + b * tokens, 0.0) * self.verify(1)

    def as_dict(self) -> dict[str, object]:
        """What was learned, for reports: the level in seconds, an extra row's share of it, and
        each draft source's seconds per drafted token in one-row steps."""
        return {"step_s": self.step_s, "row_share": self.row_share,
                "draft_token_steps": dict(sorted(self.draft_token_steps.items()))}

    def record(self, step: StepTimes) -> None:
        if step.verify_s <= 0:
            return
        last, self._last = self._last, (step.rows, step.verify_s)
        if last is not None and last[0] != step.rows:
            share = _pair_share(last, self._last)
            if share is not None:
                self.row_share += SHARE_EMA * min(max(share - self.row_share, -SHARE_CLIP), SHARE_CLIP)
        # This step's one-row step: its time over its rows' cost in one-row steps.
        unit = step.verify_s / self.steps(step.rows)
        self.step_s = _ema(self.step_s, unit)
        for tokens, seconds in step.catch_ups:
            size = tokens.bit_length()
            old_point = self.catch_up_by_size.get(size)
            steps = seconds / unit
            self.catch_up_by_size[size] = (tokens, steps) if old_point is None else (_ema(old_point[0], tokens), _ema(old_point[1], steps))
        for outcome in step.requests:
            if outcome.drafted:
                per_token = outcome.draft_s / outcome.drafted / unit
                self.draft_token_steps[outcome.method] = _ema(self.draft_token_steps.get(outcome.method), per_token)


def shared_forward(requests: int) -> float:
    """A draft-model forward shared by ``requests`` requests (one row each), in lone forwards."""
    return 1.0 + DRAFT_REQUEST_SHARE * max(requests - 1, 0)


def _pair_share(a: tuple[int, float], b: tuple[int, float]) -> float | None:
    """The row share that makes two steps' times (rows, seconds) one level apart:
    t_b (1 + s (r_a - 1)) = t_a (1 + s (r_b - 1)), clipped to [0, MAX_SHARE]; None when none
    does: the step of more rows took (r_b - 1) / (r_a - 1) times as long or more, which no
    cost of rows explains (the load changed between them)."""
    (ra, ta), (rb, tb) = sorted((a, b))
    denominator = ta * (rb - 1) - tb * (ra - 1)
    if denominator <= 0:
        return None
    return min(max((tb - ta) / denominator, 0.0), MAX_SHARE)


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``a + b x`` through two or more (x, y) points (equal weights), slope >= 0."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = max(sum((x - mx) * (y - my) for x, y in points) / sxx, 0.0) if sxx else 0.0
    return my - b * mx, b


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


@dataclass(frozen=True, slots=True)
class ReferenceCosts:
    """Costs in units of one-row steps, for planning before anything was measured: an extra row
    ``ROW_SHARE_PRIOR``, a drafted token its drafter's prior, a catch-up token ``catch_up_share``."""

    catch_up_share: float = 0.05  # an int4 draft's prefill, about 1.9 ms a token, against a 38 ms step (Zen 4)

    def verify(self, rows: int) -> float:
        return 1.0 + ROW_SHARE_PRIOR * (rows - 1)

    def draft_token(self, request: DraftCostKey) -> float:
        return request.draft_cost_prior

    def catch_up(self, tokens: int) -> float:
        return tokens * self.catch_up_share


REFERENCE_COSTS = ReferenceCosts()
