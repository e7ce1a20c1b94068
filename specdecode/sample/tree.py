"""Acceptance rules for a tree of draft tokens: several candidates per position, one forward.

The verify forward has one row per tree node plus the root (the last committed token, row 0);
row r holds the target's distribution for the token after node r's path. Node i (draft i) is
row i + 1 and its parent is row ``parents[i] + 1`` (row 0 for ``parents[i] == -1``).

Greedy: from the root, follow the child whose token is the target's argmax at the current row;
stop at a row where no child matches and emit that argmax (recovered token), or at a leaf and
emit its argmax (bonus token). The kept path is exactly what plain greedy decoding produces.

Sampling (multi-draft recursive rejection, as in SpecInfer, for point-mass candidates): at the
current row with target distribution p, try the children in order, skipping repeated tokens.
Child c is accepted with probability r(c) / sum(r), where r starts as p and each rejected child's
token is zeroed in r. On acceptance descend to c; when every child is rejected, emit a token drawn
from r (the residual). Each token emitted is then distributed exactly as the target's own sample:
child 1 is emitted with probability p(c1); child j with probability prod of the earlier
rejections times r(c_j) / sum(r) = p(c_j); any other token x with probability p(x). This needs
candidates fixed before the target's randomness is drawn, which is why trees are deterministic.

Random draws: one float64 uniform per child tried, then one draw (``sampling.sample``) for the
recovered or bonus token. Greedy draws nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specdecode.sample.sampling import sample
from specdecode.sample.chain import RESIDUAL_MIN_MASS
from specdecode.sequence import VerifyResult


def children_by_row(parents: Sequence[int]) -> list[list[int]]:
    """For each verify row (root + nodes), the node indices of its children, in draft order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    return children


def verify_tree_greedy(
    draft_tokens: Tensor,  # [K] int64
    parents: Sequence[int],  # [K] parent draft index, -1 = the root
    target_logits: Tensor,  # [K + 1, V] (logits or probs: only the argmax is used)
) -> VerifyResult:
    _check(draft_tokens, parents, target_logits)
    target_ids = target_logits.argmax(-1).tolist()  # [K + 1]
    tokens = draft_tokens.tolist()
    children = children_by_row(parents)
    row, rows, kept = 0, [0], []
    while True:
        want = target_ids[row]
        match = next((c for c in children[row] if tokens[c] == want), None)
        if match is None:
            return VerifyResult(len(kept), kept + [want], rows)
        kept.append(want)
        row = match + 1
        rows.append(row)


def verify_tree_rejection(
    draft_tokens: Tensor,  # [K] int64
    parents: Sequence[int],  # [K] parent draft index, -1 = the root
    target_probs: Tensor,  # [K + 1, V] the target's distributions, from sampling.logits_to_probs
    generator: torch.Generator,
) -> VerifyResult:
    _check(draft_tokens, parents, target_probs)
    tokens = draft_tokens.tolist()
    children = children_by_row(parents)
    row, rows, kept = 0, [0], []
    while True:
        residual = target_probs[row].double().clone()  # [V]
        p = residual.clone()
        accepted = None
        tried: set[int] = set()
        for child in children[row]:
            token = tokens[child]
            if token in tried:  # a repeated candidate was rejected already: it cannot be drawn
                continue
            tried.add(token)
            total = float(residual.sum())
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if total > 0 and u * total < float(residual[token]):
                accepted = child
                break
            residual[token] = 0.0
        if accepted is None:
            dist = residual if float(residual.sum()) > RESIDUAL_MIN_MASS else p
            extra = int(sample(dist.unsqueeze(0), generator)[0])
            return VerifyResult(len(kept), kept + [extra], rows)
        kept.append(tokens[accepted])
        row = accepted + 1
        rows.append(row)


def _check(draft_tokens: Tensor, parents: Sequence[int], target: Tensor) -> None:
    k = draft_tokens.shape[0]
    if len(parents) != k or any(not -1 <= p < i for i, p in enumerate(parents)):
        raise ValueError(f"parents must give, for each of the {k} drafts, an earlier draft or -1")
    if target.dim() != 2 or target.shape[0] != k + 1:
        raise ValueError(f"target rows must be [K + 1, V] = [{k + 1}, V], got {tuple(target.shape)}")
