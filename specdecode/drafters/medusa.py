"""Medusa drafting: heads on the target's last hidden state guess the next few tokens at once.

The verify forward that committed the last token also computed the target's hidden state at the
position before it, the state the target itself predicted that token from. Head k reads that
state and guesses the token k + 1 places after the last committed one, so one pass of the heads
proposes them all, with no drafting loop (``heads/medusa.py``).

- **Chain** (``tree_width`` 0): each head's choice in turn, until the running product of their
  probabilities falls below ``confidence`` or K. For a sampled request each draft is drawn from
  its head's distribution, which (being the same whatever the earlier drafts) is a valid draft
  distribution for the exact rejection rule.
- **Tree** (``tree_width`` w): head k's w best tokens under each of the w most probable paths of
  depth k, the K most probable paths of all kept; deterministic, so exact for sampling too.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from specdecode.drafters.base import Drafter, most_probable_tree, pick_from_subvocabulary
from specdecode.sequence import EMPTY_PROPOSAL, DraftProposal, SequenceState
from specdecode.heads.medusa import MedusaHeads
from specdecode.models import kernels
from specdecode.models.draft_heads import draft_copy
from specdecode.models.decoder import Decoder


class MedusaDrafter(Drafter):
    name: ClassVar[str] = "medusa"
    draft_cost_prior: ClassVar[float] = 0.05  # a residual block and a head per position
    stops_by_confidence: ClassVar[bool] = True
    needs_hidden_states: ClassVar[bool] = True

    def __init__(self, heads: MedusaHeads, target: Decoder, confidence: float = 0.0, tree_width: int = 0,
                 quantize: bool = True) -> None:
        # 4-bit weights: drafts never change the output, only how often they are accepted
        self.heads = draft_copy(heads.eval()) if quantize else heads.eval()
        self.hidden_layers = (target.config.num_layers,)  # the last layer's output, before the final norm
        self.norm, self.eps = target.norm.float(), target.config.rms_norm_eps
        self.confidence, self.tree_width = confidence, tree_width
        self.adapts_length = tree_width == 0
        self.vocab_size = heads.config.vocab_size
        self.state: Tensor | None = None  # the target's state before the last committed token

    def begin(self, seq: SequenceState) -> None:
        self.state = None

    def observe_hidden(self, states: Tensor) -> None:
        self.state = states[-1:]

    @torch.inference_mode()
    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        if self.state is None:
            return EMPTY_PROPOSAL
        hidden = kernels.rms_norm(self.state.float(), self.norm, self.eps)
        depth = min(k, self.heads.config.num_heads)
        logits = [lm_head(block(hidden))[0] for block, lm_head in
                  zip(self.heads.blocks[:depth], self.heads.lm_heads[:depth])]
        if self.tree_width:
            return self._tree(logits, k)
        return self._chain(logits, seq)

    def _chain(self, logits: list[Tensor], seq: SequenceState) -> DraftProposal:
        tokens, probs = [], []
        cumulative = 1.0
        for head_logits in logits:
            token, p, p_token = pick_from_subvocabulary(head_logits, self.heads.target_ids, self.vocab_size, seq,
                                                        self.confidence > 0)
            if p is not None:
                probs.append(p)
            tokens.append(token)
            cumulative *= p_token
            if cumulative < self.confidence:
                break
        return DraftProposal(torch.tensor(tokens), torch.stack(probs) if probs else None)

    def _tree(self, logits: list[Tensor], k: int) -> DraftProposal:
        w, ids = self.tree_width, self.heads.target_ids
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        frontier = [-1]
        for head_logits in logits:
            top = torch.log_softmax(head_logits, -1).topk(min(w, head_logits.shape[-1]))
            children = []
            for node in frontier:
                base = 0.0 if node < 0 else scores[node]
                for lp, choice in zip(top.values.tolist(), top.indices.tolist()):
                    children.append(len(tokens))
                    tokens.append(int(ids[choice]))
                    parents.append(node)
                    scores.append(base + lp)
            frontier = sorted(children, key=lambda i: (-scores[i], i))[:w]
        return most_probable_tree(tokens, parents, scores, k)
