"""K by load: a server's cap on drafts per request, by how many requests are running.

On a CPU one verify forward over n requests costs about one pass over the weights while the rows
are few, then grows with the rows once the matmuls are compute-bound, so speculation that pays
for one request can cost more than it saves for eight. The speculation policy
(``engine/policy.py``) weighs exactly that from measured costs for every step, so a server needs
no table; ``--k-by-load`` caps the policy for operators who want a fixed ceiling: a table
``1-2:12,3-4:6,5-:0`` (the shape of vLLM's ``num_speculative_tokens_per_batch_size``) allows up
to 12 drafts per request for one or two running requests, 6 for three or four, none from five
on. Running requests are those admitted, prompts still prefilling included, so the table turns
K down as a wave arrives rather than one step after its prefill. A count the table does not name
keeps the server's own K. ``auto`` is the policy alone (the default).

K is only ever a limit: greedy output never depends on it; sampled output keeps exactly the
target's distribution, though a seeded request's draws follow its K.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from specdecode.errors import InvalidConfigError
from specdecode.params import MAX_SPECULATIVE_TOKENS

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d*)\s*)?:\s*(\d+)\s*$")


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

    def cap(self, running: int) -> int | None:
        """The most drafts per request with ``running`` requests admitted (None: the table does
        not name that count, so the server's own K holds)."""
        return next((r.k for r in self.ranges if r.holds(running)), None)


def parse_k_by_load(text: str | None) -> KSchedule | None:
    """``--k-by-load``: None (off) or ``auto`` (the speculation policy alone), or a table."""
    if text is None or not text.strip() or text.strip() == "auto":
        return None
    return KSchedule.parse(text)
