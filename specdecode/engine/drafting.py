"""Drafting for every request of a step at once, sharing draft-model forwards.

Each request drafts through its drafter's coroutine (``Drafter.drafting``), which yields the
model calls it needs. Calls on one model in the same round run as one batched forward
(``Decoder.forward_batch``), a lone call as a plain forward (and any fused single-row path the
model has); a catch-up call (a prompt, or tokens missed while drafting was off) runs alone on
the model's prefill path. A drafter that fails, or whose shared forward fails, fails only its
own requests. Each request is charged its own drafting time plus an even share of the shared
forwards it was part of (``seconds``, its stats); for the speculation policy, which prices a
shared forward itself, a share stands for the lone forward it replaced (``solo_s``: the forward's
time over ``costs.shared_forward`` of its requests). Catch-ups are timed apart.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from torch import Tensor

from specdecode.drafters.base import CATCH_UP_TOKENS, Drafting, ModelCall
from specdecode.engine.costs import shared_forward
from specdecode.sequence import DraftProposal


@dataclass(eq=False, slots=True)
class DraftWork:
    """One request's drafting in a step: its coroutine, and what it produced and cost."""

    drafting: Drafting
    call: ModelCall | None = None  # the model call it waits on
    proposal: DraftProposal | None = None
    error: Exception | None = None
    seconds: float = 0.0  # drafting time charged to the request, catch-ups included
    solo_s: float = 0.0  # the same, each shared forward counted as the lone forward it stands for
    catch_ups: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) per catch-up

    @property
    def catch_up_s(self) -> float:
        return sum(seconds for _, seconds in self.catch_ups)


def draft_all(works: list[DraftWork]) -> None:
    """Run every coroutine of ``works`` to its proposal (or error), sharing forwards."""
    for work in works:
        _advance(work, None)
    while waiting := [w for w in works if w.call is not None]:
        groups: dict[tuple[int, bool], list[DraftWork]] = defaultdict(list)
        for work in waiting:
            call = work.call
            if call.tokens.numel() > CATCH_UP_TOKENS:
                groups[(id(work), True)].append(work)  # a catch-up runs alone
            else:
                groups[(id(call.model), call.last_only)].append(work)
        for group in groups.values():
            _run_group(group)


def _run_group(group: list[DraftWork]) -> None:
    """One forward for ``group``'s calls (all on one model), then each coroutine's next call."""
    calls = [w.call for w in group]
    t0 = time.perf_counter()
    try:
        if len(calls) == 1:
            logits: list[Tensor] = [calls[0].run()]
        else:
            logits = calls[0].model.forward_batch([(c.tokens, c.cache) for c in calls], last_only=calls[0].last_only)
    except Exception as exc:  # noqa: BLE001 - fails these requests only
        for work in group:
            work.call, work.error = None, exc
            work.drafting.close()
        return
    seconds = time.perf_counter() - t0
    for work, rows in zip(group, logits):
        work.seconds += seconds / len(group)
        work.solo_s += seconds / shared_forward(len(group))
        if calls[0].tokens.numel() > CATCH_UP_TOKENS:
            work.catch_ups.append((int(calls[0].tokens.numel()), seconds))
        _advance(work, rows)


def _advance(work: DraftWork, logits: Tensor | None) -> None:
    t0 = time.perf_counter()
    try:
        work.call = next(work.drafting) if logits is None else work.drafting.send(logits)
    except StopIteration as done:
        work.call, work.proposal = None, done.value
    except Exception as exc:  # noqa: BLE001 - fails this request only
        work.call, work.error = None, exc
    own = time.perf_counter() - t0
    work.seconds += own
    work.solo_s += own
