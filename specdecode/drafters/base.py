"""The drafter contract shared by every speculative method.

A drafter sees the committed tokens of one sequence and proposes up to ``k`` continuations. The
engine verifies them with the target and tells the drafter how many were kept, so a stateful
drafter (one with its own KV cache) can roll back. Drafters declare what they need; the engine
never branches on a method's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from specdecode.config import SamplingParams


@dataclass(slots=True)
class SequenceState:
    """One request's committed tokens and its private random stream.

    ``token_ids`` holds prompt + generated tokens. The target's KV cache holds every committed
    token except the last one, which is the first input of the next verify step.
    """

    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator = field(default_factory=torch.Generator)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass(frozen=True, slots=True)
class DraftProposal:
    tokens: Tensor  # [K] int64, K may be 0 (nothing to propose this step)
    probs: Tensor | None  # [K, V] the drafter's distribution; None = deterministic drafter

    @property
    def k(self) -> int:
        return int(self.tokens.shape[0])


EMPTY_PROPOSAL = DraftProposal(torch.empty(0, dtype=torch.long), None)


class Drafter(Protocol):
    name: ClassVar[str]

    def begin(self, seq: SequenceState) -> None:
        """A new request: index the prompt, prefill a draft model, reset state."""

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        """Up to ``k`` draft tokens continuing ``seq.token_ids``."""

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        """The first ``n_accepted`` drafts were kept and one more token was appended to ``seq``."""
