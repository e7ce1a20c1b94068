"""Training Medusa heads on captured target states (``capture.py``).

- **Start.** As FasterDecoding's Medusa: each block's linear layer at zero, so a block is the
  identity, and each head's LM head the target's rows for the truncated vocabulary; an untrained
  head k guesses the target's own next token, and training moves it k + 1 places ahead.
- **Loss.** Head k at position i learns the target's distribution for the token at i + k + 2 (the
  target's next-token distribution at position i + k + 1), renormalised over the truncated
  vocabulary: soft cross-entropy, head k weighted 0.8^k (Medusa's decay; later heads are harder
  and matter less, since their drafts count only when all before them were accepted).
- **Validation.** Teacher-forced chain acceptance: the share of response positions where heads
  0..k all guess the target's argmax, and tau = 1 + their sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specdecode.heads.medusa import MedusaConfig, MedusaHeads
from specdecode.models import kernels
from specdecode.models.decoder import Decoder
from specdecode.train.capture import Example, lm_head_rows, soft_targets

HEAD_DECAY = 0.8


def new_heads(target: Decoder, cfg: MedusaConfig, vocabulary: Tensor, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(cfg)
    heads.set_vocabulary(vocabulary)
    rows = lm_head_rows(target, vocabulary)
    with torch.no_grad():
        for block, lm_head in zip(heads.blocks, heads.lm_heads):
            for layer in block.layers:
                layer.weight.zero_()
                layer.bias.zero_()
            lm_head.weight.copy_(rows)
    return heads


class TargetNorm:
    """The target's final RMS norm, applied to captured last-layer states as the heads expect."""

    def __init__(self, target: Decoder) -> None:
        self.weight, self.eps = target.norm.float().clone(), target.config.rms_norm_eps

    def __call__(self, states: Tensor) -> Tensor:
        return kernels.rms_norm(states.float(), self.weight.to(states.device), self.eps)


def loss(heads: MedusaHeads, ex: Example, norm: TargetNorm) -> Tensor:
    hidden = norm(ex.states)
    n, total, weights = len(ex), torch.zeros((), device=hidden.device), 0.0
    for k, (block, lm_head) in enumerate(zip(heads.blocks, heads.lm_heads)):
        rows = n - k - 1  # positions i whose target for head k (at i + k + 1) exists
        if rows <= 0:
            break
        ids, probs, trained = soft_targets(heads.target_ids, heads.config.vocab_size, ex, slice(k + 1, n))
        if not trained.any():
            continue
        logq = torch.log_softmax(lm_head(block(hidden[:rows][trained])), dim=-1).gather(1, ids[trained])
        total = total + HEAD_DECAY**k * -(probs[trained] * logq).sum(-1).mean()
        weights += HEAD_DECAY**k
    return total / weights if weights else total.requires_grad_()


@torch.no_grad()
def evaluate(heads: MedusaHeads, examples: Sequence[Example], norm: TargetNorm) -> dict:
    num = heads.config.num_heads
    hits = torch.zeros(num)
    positions = 0
    for ex in examples:
        n = len(ex)
        rows = n - num  # positions where every head has a target
        if rows <= 0:
            continue
        logits = heads(norm(ex.states[:rows]))
        alive = torch.ones(rows, dtype=torch.bool)
        counted = ex.loss_mask[1 : 1 + rows]
        for k, head_logits in enumerate(logits):
            alive &= heads.target_ids[head_logits.argmax(-1)] == ex.top_ids[k + 1 : k + 1 + rows, 0]
            hits[k] += int((alive & counted).sum())
        positions += int(counted.sum())
    accept = hits / max(positions, 1)
    return {"accept": [round(float(a), 4) for a in accept], "tau": round(1.0 + float(accept.sum()), 3),
            "positions": positions}
