"""Acceptance rules: which drafted tokens the target keeps. Pure tensor functions.

Vocabulary (vLLM's):

- draft tokens: the K tokens x_0 .. x_{K-1} the drafter proposed after the committed context.
- accepted tokens: the longest prefix of the draft tokens that the rule keeps (0..K of them).
- recovered token: when draft token x_i is rejected, the token emitted in its place, drawn from
  the target row i (greedy: its argmax; sampling: from norm(max(0, p_i - q_i))).
- bonus token: when all K draft tokens are accepted, the extra token drawn from target row K,
  which the target forward computed anyway.

So every verify step emits ``num_accepted + 1`` tokens: the accepted ones, then exactly one
recovered or bonus token. Row i of the target tensors is the target's distribution for the
token at draft position i, i.e. conditioned on the context plus x_0 .. x_{i-1}.

``verify_rejection`` is the rule of Leviathan et al. 2023 and Chen et al. 2023: accept x_i with
probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a token drawn from
norm(max(0, p_i - q_i)) and stop; if all K are accepted, emit a token drawn from p_K. Each
emitted token is then distributed exactly as the target's own sample would be.

Random draws (reproducibility contract): each ``verify_rejection`` call draws, from the given
generator and in this order, exactly K float64 uniforms (one ``torch.rand(K)`` call, one per
draft position, all drawn even past the first rejection) and then exactly 1 float64 uniform
(``sampling.sample`` for the recovered or bonus token). K + 1 draws whatever the outcome, so a
seeded run is reproducible from the sequence of K values alone. ``verify_greedy`` draws nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdecode.sample.sampling import sample
from specdecode.sequence import VerifyResult

# If the residual max(0, p - q) has at most this mass, p and q agree up to rounding: draw the
# recovered token from p instead. Rejection there has probability about this mass, so the
# emitted distribution moves by at most ~1e-6 in total variation.
RESIDUAL_MIN_MASS = 1e-6


def verify_greedy(
    draft_tokens: Tensor,  # [K] int64
    target_logits: Tensor,  # [K + 1, V] (logits or probs: only the argmax is used)
) -> VerifyResult:
    """Accept while the draft token equals the target's argmax at its row.

    The extra token is the argmax of the first mismatching row (recovered) or of row K (bonus).
    Ties go to the lowest token id, as in ``torch.argmax`` and ``sampling.greedy``.
    """
    k = _check_shapes(draft_tokens, target_logits, "target_logits")
    target_ids = target_logits.argmax(-1)  # [K + 1]
    matches = draft_tokens.long() == target_ids[:k]  # [K]
    n = int(matches.int().cumprod(0).sum())
    return VerifyResult(n, draft_tokens[:n].tolist() + [int(target_ids[n])])


def verify_rejection(
    draft_tokens: Tensor,  # [K] int64
    draft_probs: Tensor | None,  # [K, V] the drafter's q_i; None = deterministic drafter
    target_probs: Tensor,  # [K + 1, V] the target's p_i
    generator: torch.Generator,
) -> VerifyResult:
    """Exact speculative sampling (lossless: emitted tokens follow the target's distribution).

    ``draft_probs`` must be the very distribution each draft token was sampled from (after the
    drafter's own temperature / top-k / top-p). ``None`` means the draft token was chosen
    deterministically (n-gram, prompt lookup): q_i is a point mass on x_i, so x_i is accepted
    with probability p_i(x_i) and the recovered token is drawn from p_i with x_i removed.
    A draft token with q_i(x_i) == 0 (which a correct drafter never proposes) is accepted iff
    p_i(x_i) > 0. ``target_probs`` should come from ``sampling.logits_to_probs``.
    """
    k = _check_shapes(draft_tokens, target_probs, "target_probs")
    vocab = target_probs.shape[-1]
    if draft_probs is not None and tuple(draft_probs.shape) != (k, vocab):
        got = tuple(draft_probs.shape)
        raise ValueError(f"draft_probs must be [K, V] = [{k}, {vocab}], got {got}")
    tokens = draft_tokens.long()  # [K]
    rows = torch.arange(k)
    p_x = target_probs[rows, tokens].double()  # [K]
    if draft_probs is None:
        q_x = torch.ones(k, dtype=torch.float64)  # [K]; a point mass on each draft token
    else:
        q_x = draft_probs[rows, tokens].double()  # [K]
    u = torch.rand(k, generator=generator, dtype=torch.float64)  # [K]
    accepted = u * q_x < p_x  # [K]; u < min(1, p/q) without dividing
    n = int(accepted.int().cumprod(0).sum())
    if n == k:
        dist = target_probs[k]  # [V]; bonus token
    else:
        q_n = None if draft_probs is None else draft_probs[n]
        dist = _residual(target_probs[n], q_n, int(tokens[n]))  # [V]; recovered token
    extra = int(sample(dist.unsqueeze(0), generator)[0])
    return VerifyResult(n, tokens[:n].tolist() + [extra])


def _residual(p: Tensor, q: Tensor | None, token: int) -> Tensor:
    """p, q: [V] -> [V] float64, the recovered-token distribution max(0, p - q) (unnormalized)."""
    p = p.double()
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - q.double()).clamp_min(0.0)
    if float(residual.sum()) <= RESIDUAL_MIN_MASS:
        return p
    return residual


def _check_shapes(draft_tokens: Tensor, target: Tensor, name: str) -> int:
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens must be [K], got shape {tuple(draft_tokens.shape)}")
    k = draft_tokens.shape[0]
    if target.dim() != 2 or target.shape[0] != k + 1:
        raise ValueError(f"{name} must be [K + 1, V] = [{k + 1}, V], got {tuple(target.shape)}")
    return k
