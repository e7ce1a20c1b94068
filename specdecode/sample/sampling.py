"""Logits -> probabilities, and one draw per row: pure functions, no state.

``logits_to_probs`` applies, in this order (the order of HF transformers and vLLM):

1. temperature: ``logits / temperature`` (after subtracting the row max, so a tiny temperature
   never overflows to +inf); ``temperature == 0`` returns a point mass on the argmax instead;
2. top-k (``top_k > 0``): keep exactly the k largest logits; ties at the boundary go to the
   lowest token id, as ``torch.argmax`` breaks ties;
3. top-p (``top_p < 1``): on the renormalized survivors of step 2, keep the smallest prefix of
   the tokens sorted by probability (ties again by lowest id) whose mass reaches ``top_p``; the
   most likely token is always kept;
4. renormalize: a softmax over the kept logits, zeros elsewhere.

Every row is a deterministic function of that row alone: no result depends on which other rows
are in the batch. A stable sort of a row's 151,936 logits costs tens of times a ``topk`` of
``_CANDIDATES`` of them (``python -m timeit -s "import torch; x = torch.randn(151936)"
"x.sort(descending=True, stable=True)"``, then ``"torch.topk(x, 1024)"``), so
top-k / top-p first look at the ``_CANDIDATES`` largest logits and fall back to a full stable
sort only for a row where that is not provably the same answer (a tie at the candidate boundary,
or a nucleus larger than the candidates). Both paths give the same bits; the tests check it.

``sample`` draws exactly one float64 uniform per row from the given generator (inverse CDF), so
the generator's stream advances by a known amount whatever the probabilities are.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdecode.params import SamplingParams

_CANDIDATES = 1024  # tokens examined by the top-k / top-p fast path before a full sort


def logits_to_probs(
    logits: Tensor,  # [N, V] any float dtype (any leading shape works)
    params: SamplingParams,
) -> Tensor:  # [N, V] float32, rows sum to 1
    """Turn logits into the sampling distribution that ``params`` asks for.

    ``temperature == 0`` gives a one-hot row on the argmax (top-k / top-p are then moot).
    The input is never modified. Raises ``ValueError`` for a row with no finite maximum
    (all -inf, a NaN, or +inf): that is a bug upstream, not a distribution.
    """
    _check_logits(logits)
    if params.greedy:
        ids = logits.argmax(-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32).scatter_(-1, ids, 1.0)
    x = logits.float()
    scaled = (x - x.amax(-1, keepdim=True)) / params.temperature
    vocab = scaled.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    top_p = float(params.top_p)
    if top_k == 0 and top_p >= 1.0:
        return torch.softmax(scaled, -1)
    flat = scaled.reshape(-1, vocab)
    keep = _keep_mask(flat, top_k, top_p, _CANDIDATES)
    probs = torch.softmax(flat.masked_fill(~keep, float("-inf")), -1)
    return probs.reshape(scaled.shape)


def sample(
    probs: Tensor,  # [N, V] non-negative; rows need not sum exactly to 1
    generator: torch.Generator,
) -> Tensor:  # [N] int64
    """Draw one token per row by inverse CDF.

    Draws exactly N float64 uniforms from ``generator`` (one ``torch.rand(N)`` call). A token
    with probability 0 is never returned. Raises ``ValueError`` for a negative or NaN entry or a
    row without positive mass.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [N, V], got shape {tuple(probs.shape)}")
    u = torch.rand(probs.shape[0], generator=generator, dtype=torch.float64)  # [N]
    return _inverse_cdf(probs, u)


def greedy(logits: Tensor) -> Tensor:  # logits: [N, V] -> [N] int64
    """The argmax of each row; ties go to the lowest token id (as ``torch.argmax``)."""
    return logits.argmax(-1)


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """probs: [N, V] >= 0; u: [N] uniforms in [0, 1) -> [N] int64 token ids."""
    if not bool((probs >= 0).all()):  # also catches NaN
        raise ValueError("probs must be non-negative (and not NaN)")
    # float64: a float32 running sum over 151,936 entries drifts by ~1e-5. Adding an exact 0.0
    # keeps the cdf flat, so a token with p == 0 is never the first entry above the target.
    cdf = probs.cumsum(-1, dtype=torch.float64)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("every row of probs needs a positive, finite total mass")
    idx = torch.searchsorted(cdf, u.double().unsqueeze(-1) * total, right=True).squeeze(-1)  # [N]
    vocab = probs.shape[-1]
    if bool((idx >= vocab).any()):  # u * total rounded up to total: take the last token with p > 0
        last_positive = vocab - 1 - (probs > 0).flip(-1).int().argmax(-1)
        idx = torch.minimum(idx, last_positive)
    return idx


def _check_logits(logits: Tensor) -> None:
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    if not bool(torch.isfinite(logits.amax(-1)).all()):
        raise ValueError("every row of logits needs a finite maximum (no NaN, no +inf, not all -inf)")


def _keep_mask(flat: Tensor, top_k: int, top_p: float, candidates: int) -> Tensor:
    """flat: [N, V] scaled logits -> [N, V] bool, the tokens that survive top-k then top-p.

    Looks at the m largest logits of each row (m = top_k, or ``candidates`` when top-k is off).
    A row whose answer could lie outside them goes through ``_keep_mask_full_sort``.
    """
    n_rows, vocab = flat.shape
    if not top_k and top_p >= 1.0:
        return torch.ones(n_rows, vocab, dtype=torch.bool)
    m = top_k if top_k else min(candidates, vocab)
    vals, ids = torch.topk(flat, m, dim=-1)  # [N, m]; the order among ties is unspecified
    threshold = vals[:, -1:]  # [N, 1]
    # The candidates are the first m of the stable sort iff no token outside ties with the m-th
    # (ties at -inf do not matter: those tokens get probability 0 anyway).
    at_or_above = flat >= threshold  # [N, V]
    untied = at_or_above.sum(-1) == m  # [N]
    if top_p >= 1.0 and bool(untied.all()):  # top-k alone: the m tokens at or above the m-th
        return at_or_above
    exact = untied | (threshold.squeeze(-1) == float("-inf"))  # [N]
    # Put the candidates into stable order: by id, then stably by value, descending.
    ids_asc, perm = ids.sort(-1)
    vals_st, order = vals.gather(-1, perm).sort(dim=-1, descending=True, stable=True)
    ids_st = ids_asc.gather(-1, order)  # [N, m]
    keep_st, complete = _nucleus(vals_st, flat, top_k, top_p)  # [N, m], [N]
    keep = torch.zeros(n_rows, vocab, dtype=torch.bool).scatter_(-1, ids_st, keep_st)
    for row in (~(exact & complete)).nonzero().flatten().tolist():
        keep[row] = _keep_mask_full_sort(flat[row], top_k, top_p)
    return keep


def _keep_mask_full_sort(row: Tensor, top_k: int, top_p: float) -> Tensor:
    """row: [V] -> [V] bool; the reference answer, by a full stable sort of the row."""
    vals, ids = row.sort(descending=True, stable=True)  # [V]
    if top_k:
        vals, ids = vals[:top_k], ids[:top_k]
    keep_st, _ = _nucleus(vals.unsqueeze(0), row.unsqueeze(0), top_k, top_p)
    return torch.zeros(row.shape[0], dtype=torch.bool).scatter_(0, ids, keep_st[0])


def _nucleus(vals_st: Tensor, flat: Tensor, top_k: int, top_p: float) -> tuple[Tensor, Tensor]:
    """Top-p on a sorted prefix of each row.

    vals_st: [N, m] the m largest scaled logits, stably sorted; flat: [N, V] the whole rows.
    Returns keep [N, m] and complete [N]: False where the nucleus may extend past the prefix.
    """
    n_rows, m = vals_st.shape
    if top_p >= 1.0:
        return torch.ones(n_rows, m, dtype=torch.bool), torch.ones(n_rows, dtype=torch.bool)
    if top_k:  # top-p acts on the distribution renormalized over the top-k survivors
        probs = torch.softmax(vals_st, -1)
    else:
        probs = torch.exp(vals_st - torch.logsumexp(flat, -1, keepdim=True))
    cum = probs.double().cumsum(-1)  # [N, m]
    keep = torch.ones(n_rows, m, dtype=torch.bool)
    keep[:, 1:] = cum[:, :-1] < top_p  # keep a token while the mass before it is below top_p
    # With top-k the prefix is the whole support; without, the nucleus must close inside it.
    complete = torch.ones(n_rows, dtype=torch.bool) if top_k else cum[:, -1] >= top_p
    return keep, complete
