"""The one verify entry point: which of a step's draft tokens the target keeps.

A step's proposal is a chain or a tree. A greedy request keeps the drafts that are their row's
argmax; a sampled one those that win their row's race (``sample/race.py``: the argmax of
``p / E`` with the request's keys for that position), which makes the kept tokens exactly the
target's sample and independent of the drafts. Both are greedy verification
(``sample/chain.verify_greedy``, ``sample/tree.verify_tree_greedy``) on the row scores. The
rejection rules (``verify_rejection``, ``verify_tree_rejection``) stay for callers without keys.
Callers see one function and one result, which ``KVCache.commit`` applies to the cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdecode.params import SamplingParams
from specdecode.sequence import DraftProposal
from specdecode.sample.sampling import logits_to_probs
from specdecode.sample.chain import verify_greedy, verify_rejection
from specdecode.sample.race import race_scores
from specdecode.sequence import VerifyResult
from specdecode.sample.tree import verify_tree_greedy, verify_tree_rejection


def verify(proposal: DraftProposal, logits: Tensor, params: SamplingParams,
           keys: Tensor | None = None, generator: torch.Generator | None = None) -> VerifyResult:
    """Keep the valid prefix (chain) or path (tree) of ``proposal`` given the target's verify
    logits [K + 1, V], and one more token. Greedy: the argmax rule. Sampled: with ``keys``
    [K + 1, V] (row i's race keys, of the position row i decides), the race rule; without, the
    exact rejection rule drawing from ``generator``."""
    if params.greedy or keys is not None:
        scores = logits if params.greedy else race_scores(logits_to_probs(logits, params), keys)
        if proposal.is_tree:
            return verify_tree_greedy(proposal.tokens, proposal.parents, scores)
        return verify_greedy(proposal.tokens, scores)
    if generator is None:
        raise ValueError("a sampled verify needs race keys or a generator")
    probs = logits_to_probs(logits, params)
    if proposal.is_tree:
        return verify_tree_rejection(proposal.tokens, proposal.parents, probs, generator)
    return verify_rejection(proposal.tokens, proposal.probs, probs, generator)
