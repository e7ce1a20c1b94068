"""What steps cost on this machine and model, measured while running.

The speculation policy (``policy.py``) weighs drafts against these. A verify forward's time grows
with its rows once the matmuls turn compute-bound (on a 2-core CPU each extra row of a quantized
target costs a share of a whole step). It is kept as a level and a shape learned apart: the
level is the one-row step's seconds now, which every step updates whatever its rows; the shape
is each row count's cost in one-row steps, learned slowly and read through a line fitted to
the counts measured (``1 + b (rows - 1)``) where a count was not. Drafting is kept per method as
the cost of a drafted token, and a draft model's catch-up (feeding tokens it missed, a prefill)
by its size, both in one-row steps too. So a spell of load (another process on a 2-core
machine), which slows every forward alike, moves the level alone: it changes no choice, and a
row count or a method not used since then is not held to what it cost during the spell.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

EMA = 0.2  # weight of a new measurement in its running mean
SHAPE_EMA = 0.1  # the same for a row count's cost in one-row steps: slower, so load moves the level
PROBE_AFTER = 16  # steps at K = 0 before a request re-measures its acceptance (policy.py)
# Before two row counts are measured, an extra row is taken to cost this share of a one-row
# step: the quantized target's extra rows cost about 0.2 of one on VNNI and 0.3 on AVX2
# (`specdecode verify-cost`, docs/GGUF_NATIVE.md).
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
    """What the speculation policy learned about one request: its acceptance and its steps
    without drafts."""

    acceptance: float | None = None  # per draft, given the ones before survived; None: not planned yet
    idle: int = 0  # steps in a row at K = 0
    probe_after: int = PROBE_AFTER


@dataclass(slots=True)
class RequestOutcome:
    """One request's part of a step: its method, drafts decided and kept, drafting time."""

    method: str
    state: RequestSpeculation
    drafted: int = 0  # positions drafted (a tree's depth)
    accepted: int = 0
    draft_s: float = 0.0  # drafting time charged to this request, catch-ups excluded

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
    shape: dict[int, float] = field(default_factory=dict)  # rows -> cost in one-row steps (rows > 1)
    draft_token_steps: dict[str, float] = field(default_factory=dict)  # by method, in one-row steps
    # catch-ups by size (the bit length of their token count): running means of (tokens, one-row steps)
    catch_up_by_size: dict[int, tuple[float, float]] = field(default_factory=dict)

    @property
    def verify_measured(self) -> bool:
        return self.step_s is not None

    def verify(self, rows: int) -> float:
        """Seconds of a verify forward over ``rows`` rows (0.0 before any was measured)."""
        return 0.0 if self.step_s is None else self.step_s * self.steps(rows)

    def steps(self, rows: int) -> float:
        """A verify forward over ``rows`` rows in one-row steps: as measured, else through the line
        ``1 + b (rows - 1)`` fitted to the counts measured (before any: the prior share a row)."""
        if rows <= 1:
            return 1.0
        if rows in self.shape:
            return self.shape[rows]
        points = [(r - 1, s - 1) for r, s in self.shape.items()]
        b = sum(x * y for x, y in points) / sum(x * x for x, _ in points) if points else ROW_SHARE_PRIOR
        return 1.0 + max(b, 0.0) * (rows - 1)

    def draft_token(self, request: DraftCostKey) -> float:
        """Seconds per drafted token of the request's method: its measured share of a one-row
        step (until measured, its drafter's prior) times that step."""
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

    def record(self, step: StepTimes) -> None:
        # This step's one-row step: its time over its rows' cost in one-row steps. The level moves
        # first, so a change of load shows in the level before it shows in the shape.
        unit = step.verify_s / self.steps(step.rows)
        self.step_s = _ema(self.step_s, unit)
        if step.rows > 1:
            sample = step.verify_s / self.step_s
            old = self.shape.get(step.rows)
            self.shape[step.rows] = sample if old is None else (1 - SHAPE_EMA) * old + SHAPE_EMA * sample
        if unit <= 0:
            return
        for tokens, seconds in step.catch_ups:
            size = tokens.bit_length()
            old_point = self.catch_up_by_size.get(size)
            steps = seconds / unit
            self.catch_up_by_size[size] = (tokens, steps) if old_point is None else (_ema(old_point[0], tokens), _ema(old_point[1], steps))
        for outcome in step.requests:
            if outcome.drafted:
                per_token = outcome.draft_s / outcome.drafted / unit
                self.draft_token_steps[outcome.method] = _ema(self.draft_token_steps.get(outcome.method), per_token)


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
