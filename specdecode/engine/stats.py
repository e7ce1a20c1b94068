"""Per-request speculative-decoding statistics, with vLLM's metric definitions.

acceptance_rate = accepted_tokens / draft_tokens; mean_acceptance_length (tau) =
1 + accepted_tokens / drafts, i.e. tokens emitted per target verify step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of those, tokens whose keys and values came from the prefix cache
    completion_tokens: int = 0
    drafts: int = 0  # verify steps that carried at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_steps: int = 0  # target forwards after prefill (verify or plain)
    plain_steps: int = 0  # of those, steps that verified no draft (the policy judged drafts would not pay)
    free_drafts: int = 0  # drafts (steps) taken from a free source: a copy from a context match
    # drafted tokens from the request's prediction that were kept / refused (OpenAI's
    # accepted_prediction_tokens / rejected_prediction_tokens)
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    draft_s: float = 0.0  # time inside the drafter's propose/accept
    verify_s: float = 0.0  # time in target forwards after prefill (verify or plain steps)

    def record_draft(self, k: int, accepted: int, depth: int | None = None) -> None:
        """One verify step of ``k`` draft tokens; a tree's ``depth`` (its longest branch) is the
        number of positions it drafted."""
        depth = k if depth is None else depth
        self.drafts += 1
        self.draft_tokens += k
        self.accepted_tokens += accepted
        grow = depth - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(depth):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        if self.completion_tokens <= 1:
            return 0.0
        return (self.total_s - self.ttft_s) / (self.completion_tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens over the whole request's wall time (prefill included)."""
        return self.completion_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the decode time alone (prefill excluded)."""
        decode = self.total_s - self.ttft_s
        return (self.completion_tokens - 1) / decode if decode > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("acceptance_rate", "mean_acceptance_length", "tpot_s", "tokens_per_s",
                     "decode_tokens_per_s"):
            d[name] = getattr(self, name)
        return d
