"""Choose which layers self-speculation skips, by measuring agreement with the target.

The data: the target's own greedy continuation of a few prompts, generated once. A skip set is
scored by teacher forcing, without any drafting loop: one forward of the skip view over
prompt + continuation, and alpha = the share of continuation tokens that the view's argmax
predicts correctly from the true prefix. That is the per-token acceptance of greedy drafting.

The speed model (per target step, in units of one target forward):

- tokens emitted: tau(alpha, K) = 1 + alpha + ... + alpha^K = (1 - alpha^(K+1)) / (1 - alpha),
  assuming each draft token survives independently with probability alpha;
- cost: 1 (the verify forward, which costs about one token on this memory-bound path) plus K draft
  forwards, each reading the kept layers and the LM head: ``draft_cost`` = their share of the
  per-token weights. Attention over the context and the embedding lookup are ignored.

Estimated speedup = tau / (1 + K * draft_cost); plain decoding is 1.0.

The search is greedy backward elimination: starting from the full model, each round tries
remaining layers, skips the one whose removal leaves the best estimate, and stops when the best
estimate no longer improves or ``max_skip`` of the layers are skipped. Each try is one forward
of a view over all samples. Trying every layer every round is quadratic in the layer count: 301
forwards for 28 layers at half skipped, at 10-25 s each for the 1.5B target on a busy 2-core CPU.
So after the first round only the few layers that scored best when last tried are tried again
(``candidates``).
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from specdecode.params import MAX_SPECULATIVE_TOKENS
from specdecode.errors import InvalidConfigError
from specdecode.models.config import ModelConfig, config_fingerprint
from specdecode.models.decoder import Decoder
from specdecode.drafters.self_spec.layers import (DEFAULT_CALIBRATION_K, DEFAULT_CALIBRATION_TOKENS, DEFAULT_CANDIDATES,
                                                   DEFAULT_MAX_SKIP, SkipChoice)
from specdecode.drafters.self_spec.skip import skip_layers
from specdecode.sample.sampling import greedy
from specdecode.tokenizer import Tokenizer


# Short chat and code requests: the workloads self-speculation is meant for.
BUILTIN_PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python in a few sentences.",
    "Complete this function:\ndef fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "What is speculative decoding? Answer in two sentences.",
    "Write a bash command that counts the lines of all .py files under the current directory.",
)


@dataclass(frozen=True, slots=True)
class Sample:
    """A prompt followed by the target's greedy continuation of it."""

    ids: list[int]
    prompt_len: int

    @property
    def continuation_len(self) -> int:
        return len(self.ids) - self.prompt_len


@dataclass(frozen=True, slots=True)
class Candidate:
    skip: list[int]
    alpha: float
    speedup: float


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str], chat: bool = True) -> list[list[int]]:
    """Token ids of each prompt, as a user message in the chat template when ``chat`` and the
    model has one (the setting an instruct model is served in), else as raw text."""
    chat = chat and bool(tokenizer.chat_template)
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]) if chat else p)
           for p in prompts]
    if not ids or any(not x for x in ids):
        raise InvalidConfigError("calibration needs at least one prompt, and no prompt may be empty")
    return ids


def greedy_continuation(target: Decoder, prompt_ids: list[int], max_tokens: int,
                        stop_ids: Collection[int] = ()) -> Sample:
    """Plain greedy decoding of up to ``max_tokens`` tokens, ending after a stop token."""
    if max_tokens < 1:
        raise InvalidConfigError(f"max tokens must be at least 1, got {max_tokens}")
    if len(prompt_ids) + max_tokens > target.max_context:
        raise InvalidConfigError(f"a prompt of {len(prompt_ids)} tokens plus {max_tokens} new tokens exceeds "
                                 f"the model's context of {target.max_context}; shorten it or lower max tokens")
    cache = target.new_cache(len(prompt_ids) + max_tokens)
    ids = list(prompt_ids)
    logits = target.forward(torch.tensor(ids), cache, last_only=True)
    for _ in range(max_tokens):
        token = greedy(logits)  # [1]
        ids.append(int(token))
        if ids[-1] in stop_ids:
            break
        logits = target.forward(token, cache)
    return Sample(ids, len(prompt_ids))


def agreement(view: Decoder, samples: Sequence[Sample]) -> float:
    """Teacher-forced alpha: how often the view's argmax is the target's next token."""
    matches = total = 0
    for s in samples:
        cache = view.new_cache(len(s.ids))
        p = s.prompt_len
        if p > 1:  # the prompt only fills the cache: skip the LM head on its rows
            view.forward(torch.tensor(s.ids[: p - 1]), cache, last_only=True)
        logits = view.forward(torch.tensor(s.ids[p - 1 : -1]), cache)  # [continuation, V]
        matches += int((logits.argmax(-1) == torch.tensor(s.ids[p:])).sum())
        total += s.continuation_len
    return matches / total


def expected_tokens(alpha: float, k: int) -> float:
    """tau: tokens emitted per verify step with K drafts each surviving with probability alpha."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def draft_cost(config: ModelConfig, kept: int) -> float:
    """One draft forward with ``kept`` layers, as a fraction of a target forward (weights read)."""
    d, inner = config.hidden_size, config.intermediate_size
    attn = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim * d + d * config.num_heads * config.head_dim
    layer = attn + 3 * d * inner
    head = config.vocab_size * d
    return (kept * layer + head) / (config.num_layers * layer + head)


def estimated_speedup(alpha: float, k: int, cost: float) -> float:
    return expected_tokens(alpha, k) / (1.0 + k * cost)


def best_draft_length(alpha: float, cost: float) -> int:
    return max(range(1, MAX_SPECULATIVE_TOKENS + 1), key=lambda k: estimated_speedup(alpha, k, cost))


def max_skipped(num_layers: int, k: int, max_skip: float) -> int:
    """How many layers the search may skip; ``InvalidConfigError`` for settings it cannot use."""
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise InvalidConfigError(f"k must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
    if not 0.0 < max_skip < 1.0:
        raise InvalidConfigError(f"max skip is a fraction of the layers in (0, 1), got {max_skip}")
    limit = min(num_layers - 1, int(max_skip * num_layers))
    if limit < 1:
        raise InvalidConfigError(f"max skip {max_skip} of {num_layers} layers allows no layer to be skipped; "
                                 "raise it")
    return limit


def search_skip(target: Decoder, samples: Sequence[Sample], k: int = DEFAULT_CALIBRATION_K,
                max_skip: float = DEFAULT_MAX_SKIP, progress: bool = True,
                candidates: int = DEFAULT_CANDIDATES) -> list[Candidate]:
    """Greedy backward elimination; returns the set chosen after each round (the last is best).

    The first round tries every layer. Later rounds try only the ``candidates`` remaining layers
    that scored best when last tried (lazy greedy: a layer that hurt little before usually still
    does), which turns a quadratic number of forwards into a linear one; 0 tries every layer
    every round. The first round always picks a layer, even if no single skip beats plain
    decoding, so that a choice exists; its estimate then says self-speculation will not pay.
    """
    from tqdm import tqdm

    n = target.config.num_layers
    limit = max_skipped(n, k, max_skip)
    if not samples:
        raise InvalidConfigError("calibration needs at least one sample")
    if candidates < 0:
        raise InvalidConfigError(f"candidates must be 0 (all layers) or more, got {candidates}")
    width = [n - r if r == 0 or candidates == 0 else min(n - r, candidates) for r in range(limit)]
    last_score = {layer: 0.0 for layer in range(n)}  # the last speedup estimated with it skipped
    history: list[Candidate] = []
    skip: list[int] = []
    with tqdm(total=sum(width), desc="calibrating", unit="forward", file=sys.stderr, disable=not progress) as bar:
        for tried in width:
            cost = draft_cost(target.config, n - len(skip) - 1)
            remaining = sorted((i for i in range(n) if i not in skip), key=lambda i: -last_score[i])
            scored = []
            for layer in sorted(remaining[:tried]):
                trial = sorted(skip + [layer])
                alpha = agreement(skip_layers(target, trial), samples)
                scored.append(Candidate(trial, alpha, estimated_speedup(alpha, k, cost)))
                last_score[layer] = scored[-1].speedup
                bar.update()
            best = max(scored, key=lambda c: c.speedup)  # ties: the lowest layer
            if history and best.speedup <= history[-1].speedup:
                break
            history.append(best)
            skip = best.skip
            bar.set_postfix(skipped=len(skip), alpha=f"{best.alpha:.3f}", speedup=f"{best.speedup:.2f}")
    return history


def calibrate(target: Decoder, model_dir: Path, samples: Sequence[Sample], k: int = DEFAULT_CALIBRATION_K,
              max_skip: float = DEFAULT_MAX_SKIP, progress: bool = True,
              candidates: int = DEFAULT_CANDIDATES) -> tuple[SkipChoice, list[Candidate]]:
    """Search a skip set for the model in ``model_dir`` (loaded as ``target``); return the choice
    to store and the per-round history."""
    history = search_skip(target, samples, k, max_skip, progress, candidates)
    chosen = history[-1]
    cost = draft_cost(target.config, target.config.num_layers - len(chosen.skip))
    choice = SkipChoice(
        skip=chosen.skip, alpha=chosen.alpha, estimated_speedup=chosen.speedup, k=k,
        best_k=best_draft_length(chosen.alpha, cost), draft_cost=cost, num_layers=target.config.num_layers,
        fingerprint=config_fingerprint(model_dir), prompts=len(samples),
        tokens=sum(s.continuation_len for s in samples),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    return choice, history
