"""Training an EAGLE-3 head on captured target states (``capture.py``).

- **Vocabulary.** The draft vocabulary is the ``draft_vocab_size`` tokens the target most often
  predicts (its argmax) on the training positions, ascending, as SpecForge builds ``d2t`` (it
  counts the data's tokens; the target's choices are what drafts must match).
- **Start.** ``lm_head`` starts as the target's LM head rows for those tokens and ``norm`` as the
  target's final norm; ``fc`` starts by passing the highest captured layer through and the
  layer's output projections at zero. The untrained head's output is then the target's own late
  state read through the target's own head, which guesses the token one place too early;
  training moves it one place on rather than learning the token space from scratch.
- **Loss.** The training-time test of EAGLE-3 (``Eagle3Head.unrolled_logits``): ``steps`` draft
  steps, each fed the previous step's output, step j weighted 0.8^j (SpecForge's decay). Each
  step's target is the target's next-token distribution, restricted to the draft vocabulary and
  renormalised (the soft cross-entropy, i.e. forward KL up to a constant): forward KL rewards
  covering the target's likely tokens, which is what the greedy argmax and the sampled acceptance
  min(p, q) both need. Positions whose target argmax is outside the draft vocabulary are
  skipped, as in SpecForge: no draft could be accepted there.
- **Validation.** Teacher-forced acceptance: the share of positions where step j's argmax is the
  target's, for all steps up to j; and tau = 1 + the expected accepted drafts of a greedy chain of
  ``steps`` (what one verify step yields), over all response positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from specdecode.heads.eagle3 import Eagle3Config, Eagle3Head
from specdecode.models.decoder import Decoder
from specdecode.train.capture import Example, lm_head_rows, soft_targets

TTT_STEPS = 7  # SpecForge's and EAGLE-3's unroll length
STEP_DECAY = 0.8

Embed = Callable[[Tensor], Tensor]


def new_head(target: Decoder, cfg: Eagle3Config, vocabulary: Tensor, seed: int = 0) -> Eagle3Head:
    """A head for ``target`` over ``vocabulary``, started as the module docstring says."""
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    head.set_vocabulary(vocabulary)
    with torch.no_grad():
        head.lm_head.weight.copy_(lm_head_rows(target, vocabulary))
        head.norm.weight.copy_(target.norm.float())
        h, ht = cfg.hidden_size, cfg.target_hidden_size
        if h == ht:
            head.fc.weight.zero_()
            head.fc.weight[:, -ht:] = torch.eye(h)
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
    return head


def unrolled(head: Eagle3Head, ex: Example, embed: Embed, steps: int) -> tuple[list[Tensor], int]:
    """Each step's logits over the rows that have a target for every step, and the row count."""
    t = len(ex) - steps
    with torch.no_grad():
        embeds = embed(ex.tokens[1 : t + steps]).float()
    return head.unrolled_logits(ex.states[:t].float(), embeds, steps), t


def loss(head: Eagle3Head, ex: Example, embed: Embed, steps: int = TTT_STEPS) -> Tensor:
    """The weighted soft cross-entropy of the unrolled steps (a scalar; 0 for a short example)."""
    if len(ex) <= steps:
        return torch.zeros((), requires_grad=True)
    logits, t = unrolled(head, ex, embed, steps)
    total = torch.zeros(())
    weights = 0.0
    for j, step in enumerate(logits):
        ids, probs, trained = soft_targets(head.target_ids, head.config.vocab_size, ex, slice(j + 1, j + 1 + t))
        if not trained.any():
            continue
        logq = torch.log_softmax(step[trained], dim=-1).gather(1, ids[trained])
        total = total + STEP_DECAY**j * -(probs[trained] * logq).sum(-1).mean()
        weights += STEP_DECAY**j
    return total / weights if weights else total.requires_grad_()


@torch.no_grad()
def evaluate(head: Eagle3Head, examples: Sequence[Example], embed: Embed, steps: int = TTT_STEPS) -> dict:
    """Teacher-forced acceptance on held-out examples: ``accept`` [steps] (the share of response
    positions where every step up to j drafts the target's argmax) and ``tau``."""
    hits = torch.zeros(steps)
    positions = 0
    for ex in examples:
        if len(ex) <= steps:
            continue
        logits, t = unrolled(head, ex, embed, steps)
        rows = ex.loss_mask[1 : 1 + t]
        alive = torch.ones(t, dtype=torch.bool)
        for j, step in enumerate(logits):
            guess = head.target_ids[step.argmax(-1)]
            alive &= guess == ex.top_ids[j + 1 : j + 1 + t, 0]
            hits[j] += int((alive & rows).sum())
        positions += int(rows.sum())
    accept = hits / max(positions, 1)
    return {"accept": [round(float(a), 4) for a in accept], "tau": round(1.0 + float(accept.sum()), 3),
            "positions": positions}
