"""Synthetic acceptance: drafts kept by a given law instead of the target's judgement.

For measuring, never for serving. How fast speculation runs depends on two things: how often
drafts are accepted (the drafter's quality on the workload) and what drafting and verifying cost
(the engine). Forcing the acceptance law separates them: at a fixed law, a faster row is a
cheaper engine, whatever the drafter. vLLM's synthetic rejection sampler and llama.cpp's
synthetic draft acceptance serve the same purpose.

Draft position i is accepted with probability ``rates[min(i, len(rates) - 1)]`` given that every
earlier one was, so one rate P gives acceptance lengths with P(n >= i) = P ** i. The emitted
tokens are the accepted drafts and then the target's own token at the first rejected position
(its argmax, or a draw from it when sampling), so the step emits ``n + 1`` tokens as a real step
does. **The output is not the target's**: a wrongly accepted draft stays in it. The bench labels
such rows and skips their identity check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specdecode.params import SamplingParams
from specdecode.sequence import DraftProposal
from specdecode.errors import InvalidConfigError
from specdecode.sequence import VerifyResult
from specdecode.sample.sampling import greedy, logits_to_probs, sample


def synthetic_length(k: int, rates: Sequence[float], generator: torch.Generator) -> int:
    """Accepted drafts out of ``k`` under the law ``rates``: k uniforms drawn whatever the outcome,
    so a seeded run's draws depend on the K values alone (like ``verify_rejection``)."""
    draws = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
    accepted = 0
    for i, u in enumerate(draws):
        if u >= rates[min(i, len(rates) - 1)]:
            break
        accepted += 1
    return accepted


def verify_synthetic(proposal: DraftProposal, logits: Tensor, params: SamplingParams, rates: Sequence[float],
                     generator: torch.Generator) -> VerifyResult:
    """Keep ``synthetic_length`` drafts of a chain, then the target's token at the next row."""
    if proposal.is_tree:
        raise InvalidConfigError("synthetic acceptance applies to chains; draw trees with a real rule "
                                 "(drop head_tree_width, or method tree)")
    drafts = proposal.tokens.tolist()
    n = synthetic_length(len(drafts), rates, generator)
    row = logits[n : n + 1]
    last = greedy(row) if params.greedy else sample(logits_to_probs(row, params), generator)
    return VerifyResult(num_accepted=n, tokens=drafts[:n] + [int(last[0])])
