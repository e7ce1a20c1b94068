"""A trace of the step loop, one JSON line a step, for finding where a step's time goes.

Set ``SPECDECODE_STEP_TRACE`` to a file path and every ``Batch`` (solo requests, the bench, the
server) appends one line per step to it: the step's wall time, its prefill chunk, its drafting
(with each catch-up, a draft model's prefill of tokens it missed), its verify forward and
commit, and per decoding request the source the policy picked, the drafts it planned and the
ones kept. The policy sees only the verify forward and each request's drafting charge; a step
also spends time outside both (sampling, bookkeeping, the server's events), which this shows.
``scripts/step_trace.py`` summarises a trace.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import IO

ENV = "SPECDECODE_STEP_TRACE"


@dataclass(slots=True)
class RequestRecord:
    """One decoding request's part of a traced step."""

    source: str | None  # the draft source the policy picked (None: its drafter offered none)
    planned: int = 0  # drafts the policy chose
    drafted: int = 0  # drafts proposed (a confident drafter may stop early)
    accepted: int = 0


@dataclass(slots=True)
class StepRecord:
    """One step's times in seconds, and its requests."""

    t: float = field(default_factory=time.time)
    running: int = 0  # requests in the batch (prefilling ones included)
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    draft_s: float = 0.0  # drafting wall time, catch-ups included
    catch_ups: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds)
    rows: int = 0  # verify rows
    verify_s: float = 0.0
    commit_s: float = 0.0
    step_s: float = 0.0
    requests: list[RequestRecord] = field(default_factory=list)


class StepTrace:
    """Appends ``StepRecord`` lines to a file (line-buffered, so a killed server keeps them)."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the process
        self._lock = threading.Lock()  # a server may run more than one batch

    def write(self, record: StepRecord) -> None:
        line = json.dumps(asdict(record))
        with self._lock:
            self._file.write(line + "\n")


_TRACE: StepTrace | None = None


def step_trace() -> StepTrace | None:
    """The process's trace when ``SPECDECODE_STEP_TRACE`` names a file, else None."""
    global _TRACE
    path = os.environ.get(ENV)
    if not path:
        return None
    if _TRACE is None:
        _TRACE = StepTrace(path)
    return _TRACE
