"""The one verify entry point: which of a step's draft tokens the target keeps.

A step's proposal is a chain or a tree, and the request decodes greedily or samples; the four
rules live in ``sample/chain.py`` (``verify_greedy``, ``verify_rejection``) and ``sample/tree.py``
(``verify_tree_greedy``, ``verify_tree_rejection``), each exact for its case. Callers see one
function and one result, which ``KVCache.commit`` applies to the cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdecode.params import SamplingParams
from specdecode.sequence import DraftProposal
from specdecode.sample.sampling import logits_to_probs
from specdecode.sample.chain import verify_greedy, verify_rejection
from specdecode.sequence import VerifyResult
from specdecode.sample.tree import verify_tree_greedy, verify_tree_rejection


def verify(proposal: DraftProposal, logits: Tensor, params: SamplingParams,
           generator: torch.Generator) -> VerifyResult:
    """Keep the valid prefix (chain) or path (tree) of ``proposal`` given the target's verify
    logits [K + 1, V], and one more token: greedy identity, or the exact rejection rule."""
    if proposal.is_tree:
        if params.greedy:
            return verify_tree_greedy(proposal.tokens, proposal.parents, logits)
        return verify_tree_rejection(proposal.tokens, proposal.parents, logits_to_probs(logits, params), generator)
    if params.greedy:
        return verify_greedy(proposal.tokens, logits)
    return verify_rejection(proposal.tokens, proposal.probs, logits_to_probs(logits, params), generator)
