"""What a trained drafter learns from: the target's hidden states and next-token distributions
over training sequences, captured once from the target's own forwards.

A head is trained to predict the *target's* distribution, not the text: its drafts are verified
by the target, so agreeing with the target is all that counts. Each position keeps the states of
the layers the head reads and the target's ``TOP`` most probable next tokens with their
log-probabilities; the mass beyond them is small and a draft rarely gains from matching it. That
is 0.4 KB per position for the distribution instead of 600 KB for the full logits of a 152k
vocabulary, so a CPU box holds enough positions for a training budget of hours.

The forwards run through the same ``Decoder`` (and the same quantized weights) that verifies at
run time, in the prefill chunks ``Generation`` uses.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from specdecode.engine.generation import PREFILL_CHUNK
from specdecode.files import atomic_path
from specdecode.models.decoder import Decoder, HiddenCapture

TOP = 32  # next-token candidates kept per position


@dataclass(frozen=True, slots=True)
class TrainingSequence:
    """A training sequence: token ids, and from which position on they are trained on (the
    response after a prompt)."""

    token_ids: list[int]
    prompt_len: int


@dataclass(slots=True)
class Example:
    """One captured sequence. Row i describes position i."""

    tokens: Tensor  # [n] int64
    loss_mask: Tensor  # [n] bool: position i's next token is part of the response (trained on)
    states: Tensor  # [n, len(layers) * D] bfloat16: the target's hidden states (none for DistillSpec)
    top_ids: Tensor  # [n, TOP] int64: the target's most probable tokens after position i
    top_logp: Tensor  # [n, TOP] float32: their log-probabilities under the full distribution

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@torch.inference_mode()
def capture(target: Decoder, seq: TrainingSequence, layers: Sequence[int]) -> Example:
    """Run ``target`` over ``seq`` and keep what training needs."""
    ids = torch.tensor(seq.token_ids)
    cache = target.new_cache(len(ids))
    hidden = HiddenCapture(tuple(layers)) if layers else None
    top_ids, top_logp = [], []
    for start in range(0, len(ids), PREFILL_CHUNK):
        logits = target.forward(ids[start : start + PREFILL_CHUNK], cache, capture=hidden)
        top = torch.log_softmax(logits.float(), dim=-1).topk(TOP, dim=-1)
        top_ids.append(top.indices)
        top_logp.append(top.values)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[max(seq.prompt_len - 1, 0) :] = True  # from the prompt's last position, which predicts the response
    states = hidden.take() if hidden is not None else torch.empty(len(ids), 0)  # a draft model reads tokens only
    return Example(ids, mask, states.to(torch.bfloat16), torch.cat(top_ids), torch.cat(top_logp))


def save_examples(examples: Sequence[Example], path: Path) -> None:
    """One safetensors file per shard of examples (written whole, then renamed)."""
    tensors: dict[str, Tensor] = {}
    for i, ex in enumerate(examples):
        for name in Example.__slots__:
            tensors[f"{i}.{name}"] = getattr(ex, name).contiguous()
    with atomic_path(path, sync=False) as tmp:  # captured again if lost
        save_file(tensors, str(tmp))


def load_examples(path: Path) -> list[Example]:
    tensors = load_file(str(path))
    count = len({key.split(".", 1)[0] for key in tensors})
    return [Example(**{name: tensors[f"{i}.{name}"] for name in Example.__slots__}) for i in range(count)]


def draft_vocabulary(examples: Sequence[Example], size: int, vocab_size: int) -> Tensor:
    """The ``size`` target ids the target most often predicts on training positions, ascending
    (padded with the lowest unused ids when fewer were seen)."""
    counts: Counter[int] = Counter()
    for ex in examples:
        counts.update(ex.top_ids[ex.loss_mask, 0].tolist())
    chosen = [token for token, _ in counts.most_common(size)]
    if len(chosen) < size:
        seen = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in seen][: size - len(chosen)]
    return torch.tensor(sorted(chosen))


def soft_targets(target_ids: Tensor, vocab_size: int, ex: Example, rows: slice) -> tuple[Tensor, Tensor, Tensor]:
    """What a drafter over the draft vocabulary ``target_ids`` learns at positions ``rows``: the
    draft ids of the target's top tokens (0 where outside the draft vocabulary, with probability
    0), their probabilities renormalised over the draft vocabulary, and whether the row is
    trained on (a response position whose target argmax a draft could match)."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[target_ids] = torch.arange(target_ids.shape[0])
    ids = index[ex.top_ids[rows]]
    logp = ex.top_logp[rows].float().masked_fill(ids < 0, -torch.inf)
    probs = torch.softmax(logp, dim=-1).nan_to_num(0.0)
    trained = ex.loss_mask[rows] & (ids[:, 0] >= 0)
    return ids.clamp_min(0), probs, trained


def lm_head_rows(target: Decoder, ids: Tensor) -> Tensor:
    """Float rows ``ids`` of the target's LM head, whatever its form (float, int8 rows, GGUF):
    where heads start their own LM heads."""
    from specdecode.models.gguf_planes import GGUFLinear, GGUFWeight

    w = target.lm_head
    if isinstance(w, Tensor):
        return w[ids].float()
    if isinstance(w, GGUFLinear) and len(w.parts) == 1:
        w = w.parts[0]
    if isinstance(w, GGUFWeight):
        return w.rows(ids)
    return w.dequantize()[ids].float()
