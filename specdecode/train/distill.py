"""DistillSpec: fine-tune the draft model toward its target, so more of its drafts are accepted.

**Data is on-policy.** The draft writes the responses (``draft_responses``), with the weights
and int4 quantization it drafts with at run time, and the target scores every position
(``capture.capture``: the target's top tokens and log-probabilities). The draft thus learns on
the prefixes it produces itself, where its mistakes happen, which DistillSpec (Zhou et al.,
2023) found to matter most. The responses are written once, by the draft as it was before
training, not regenerated as it learns: on CPU a regeneration costs as much as a pass of
training.

**The divergence is forward KL**, KL(target || draft), as soft cross-entropy against the target's
distribution over its top tokens (``TOP``), renormalised. Why not TVD, which is exactly one minus
the sampled acceptance rate: its gradient is the sign of q - p, flat in how wrong the draft is,
so it moves slowly from a small budget, and it needs the target's full distribution where the
capture keeps 32 tokens. Forward KL puts the draft's mass where the target's is, which is what
greedy acceptance (the argmax agreeing) needs, and DistillSpec reports it among the best
divergences for greedy decoding.

**Acceptance is checked after quantization** (``quantized_acceptance``): the merged draft is
quantized to int4 as ``LLM`` does at load, and measured against the target beside the untrained
draft, because what the adapters gain must survive 4-bit weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from specdecode.params import SamplingParams
from specdecode.engine.engine import Engine
from specdecode.models.draft_quant import INT4_MAX_ROWS
from specdecode.models.decoder import Decoder
from specdecode.tokenizer import Tokenizer
from specdecode.train.capture import Example
from specdecode.train.student import Student


def draft_responses(draft: Decoder, tokenizer: Tokenizer, max_new_tokens: int, temperature: float,
                    seed: int) -> Callable[[list[int]], list[int]]:
    """A function answering a prompt's ids with the draft's own continuation (plain decoding of
    the draft alone, stopping at its end-of-turn token)."""
    engine = Engine(draft, tokenizer, max_seq_len=8192)
    calls = itertools.count()

    def respond(prompt: list[int]) -> list[int]:
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + next(calls))
        return engine.generate(prompt, params).token_ids

    return respond


def _targets(ex: Example) -> tuple[Tensor, Tensor, Tensor]:
    """Trained rows, the target's top ids there, and its probabilities renormalised over them."""
    rows = ex.loss_mask.nonzero().squeeze(1)
    return rows, ex.top_ids[rows], torch.softmax(ex.top_logp[rows].float(), dim=-1)


def loss(student: Student, ex: Example) -> Tensor:
    """Forward KL from the target to the draft (up to the target's entropy) on the response
    positions of one sequence."""
    rows, ids, probs = _targets(ex)
    logq = torch.log_softmax(student(ex.tokens)[rows], dim=-1)
    return -(probs * logq.gather(1, ids)).sum(-1).mean()


def agreement(logits: Tensor, ex: Example) -> tuple[int, float, float]:
    """(positions, greedy agreements, sum of min(p, q)) of draft ``logits`` [T, V] on ``ex``'s
    response rows. The last is the sampled acceptance over the target's top tokens: a lower bound
    on the true one, which also counts the mass beyond them."""
    rows, ids, _ = _targets(ex)
    q = torch.softmax(logits[rows].float(), dim=-1)
    agree = (q.argmax(-1) == ids[:, 0]).sum().item()
    overlap = torch.minimum(ex.top_logp[rows].float().exp(), q.gather(1, ids)).sum().item()
    return int(rows.shape[0]), float(agree), float(overlap)


def summarize(counts: Sequence[tuple[int, float, float]]) -> dict:
    n = sum(c[0] for c in counts) or 1
    return {"agree": round(sum(c[1] for c in counts) / n, 4), "accept": round(sum(c[2] for c in counts) / n, 4),
            "positions": sum(c[0] for c in counts)}


@torch.no_grad()
def evaluate(student: Student, examples: Sequence[Example]) -> dict:
    """Greedy agreement and sampled acceptance of the (float) student on held-out sequences."""
    return summarize([agreement(student(ex.tokens), ex) for ex in examples])


@torch.inference_mode()
def quantized_acceptance(draft: Decoder, examples: Sequence[Example]) -> dict:
    """The same measures for a draft ``Decoder`` as it drafts (quantized). Fed a few rows per
    forward, as drafting feeds it: calls of many rows take another path (``draft_quant.linear_draft``:
    int8 with activations quantized per call, or the GGUF weights as shipped) whose precision
    differs from the decode rows' int4 kernel."""
    counts = []
    for ex in examples:
        cache = draft.new_cache(len(ex))
        logits = torch.cat([draft.forward(ex.tokens[s : s + INT4_MAX_ROWS], cache)
                            for s in range(0, len(ex), INT4_MAX_ROWS)])
        counts.append(agreement(logits, ex))
    return summarize(counts)


def merged_decoder(student: Student, quantize: str | None) -> Decoder:
    """The student with its adapters merged, as ``LLM`` would load the saved folder."""
    from specdecode.models.packed import pack

    packed = pack(student.merged_weights(torch.float32), student.config, torch.float32)
    return Decoder.build(student.config, packed, torch.float32, role="draft", quantize=quantize)

