"""How many tokens to draft at the next step of one request.

Acceptance varies between requests and within one answer (boilerplate code is predictable, a
fresh explanation is not), while each drafted token costs draft time and verify width. The
adaptive schedule follows the request's own acceptance: after a step whose drafts were all
accepted it drafts two more next time, after a rejection one fewer, within ``[1, k_max]``
(the schedule Hugging Face calls "heuristic"). Exactness never depends on K.
"""

from __future__ import annotations


class DraftLength:
    def __init__(self, k_max: int, adaptive: bool = True) -> None:
        self.k_max = k_max
        self.adaptive = adaptive
        self.k = k_max

    def update(self, drafted: int, accepted: int) -> None:
        """Record one verify step that carried ``drafted`` tokens of which ``accepted`` were kept."""
        if not self.adaptive or drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.k_max, self.k + 2)
        else:
            self.k = max(1, self.k - 1)
