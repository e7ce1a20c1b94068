"""Log-probabilities of the emitted tokens, from the target's own rows.

Every emitted token is decided on one row of a target forward (a verify row, or the prefill's
last row), and that row holds the same bits whether the step verified drafts or decoded plainly
(the kernels are batch-invariant). Each row goes through ``log_softmax`` alone, as a [V] tensor,
so a token's logprob does not depend on how many rows its forward had: speculative decoding
returns bit for bit the logprobs plain decoding returns.

The values are those of the logits the acceptance rule saw: after a structured-output mask,
before temperature, top-k and top-p (vLLM's default ``raw_logprobs``). A token the mask forbids
has log-probability -inf: it is never among the alternatives, and a chosen token's value is
floored at ``LOGPROB_FLOOR`` (OpenAI's "very unlikely") so it stays a JSON number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One emitted token's log-probability and the ``n`` most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first; ties by lower id


def token_logprobs(rows: Tensor, tokens: list[int], n_top: int) -> list[TokenLogprob]:
    """rows: [N, V] the logits each token was chosen from (row i for tokens[i]); N >= len(tokens)."""
    out = []
    for row, token in zip(rows, tokens):
        logp = torch.log_softmax(row.float(), -1)  # [V], one row at a time (see the module docstring)
        top: tuple[tuple[int, float], ...] = ()
        if n_top:  # tokens a grammar forbids (-inf) are not alternatives
            values, ids = _top_stable(logp, n_top)
            top = tuple((int(i), float(v)) for i, v in zip(ids, values) if v > float("-inf"))
        out.append(TokenLogprob(int(token), _floor(float(logp[token])), top))
    return out


def _top_stable(logp: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The n largest entries, ties among them ordered by lower id (``topk`` leaves that open)."""
    values, ids = torch.topk(logp, min(n, logp.shape[0]))
    order = sorted(range(len(ids)), key=lambda j: (-float(values[j]), int(ids[j])))
    return values[order], ids[order]


def _floor(value: float) -> float:
    return max(value, LOGPROB_FLOOR)
