"""The propose -> verify -> commit loop for one sequence at a time.

Reads like the papers: the drafter proposes K tokens, the target scores the last committed token
plus the K drafts in one forward, an exact acceptance rule keeps a prefix and supplies one more
token, and the target's cache is trimmed back to the kept tokens. ``none`` is the same loop with
K = 0, so plain decoding and speculative decoding share every line of the target path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdecode.config import MAX_SPECULATIVE_TOKENS, SamplingParams
from specdecode.draft_length import DraftLength
from specdecode.drafters.base import EMPTY_PROPOSAL, DraftProposal, Drafter, SequenceState
from specdecode.errors import InvalidConfigError, PromptTooLongError
from specdecode.models.decoder import Decoder
from specdecode.sampling import greedy, logits_to_probs, sample
from specdecode.stats import RequestStats
from specdecode.stops import StopChecker
from specdecode.tokenizer import Tokenizer
from specdecode.verify import VerifyResult, verify_greedy, verify_rejection


@dataclass(slots=True)
class GenerationOutput:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_token_ids: list[int]
    method: str
    stats: RequestStats = field(default_factory=RequestStats)


@dataclass(frozen=True, slots=True)
class StreamEvent:
    text: str  # newly final text (never retracted)
    token_ids: list[int]  # tokens committed in this step
    output: GenerationOutput | None = None  # set on the last event


class Engine:
    """Runs requests against one target model, reusing one preallocated KV cache."""

    def __init__(self, target: Decoder, tokenizer: Tokenizer, max_seq_len: int) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.max_seq_len = min(max_seq_len, target.max_context)
        self.cache = target.new_cache(self.max_seq_len)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise PromptTooLongError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.max_seq_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens but the context holds {self.max_seq_len} "
                "including at least one new token; shorten the prompt or raise max_seq_len"
            )

    def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        drafter: Drafter | None,
        k: int,
        adaptive: bool = True,
    ) -> Iterator[StreamEvent]:
        """Generate for one prompt, yielding each step's newly final text.

        ``k`` is the most tokens drafted per step; with ``adaptive`` the draft length follows the
        request's acceptance (see ``draft_length.py``), otherwise it is always ``k``.
        """
        self.check_prompt(prompt_ids)
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:  # wider verify calls would leave the invariant kernel
            raise InvalidConfigError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        start = time.perf_counter()
        stats = RequestStats(prompt_tokens=len(prompt_ids))
        gen = torch.Generator()
        gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        seq = SequenceState(list(prompt_ids), len(prompt_ids), params, gen)
        draft_length = DraftLength(k, adaptive)
        stops = StopChecker(self.tokenizer, params)
        self.cache.reset()

        logits = self.target.forward(torch.tensor(prompt_ids), self.cache, last_only=True)
        stats.prefill_s = time.perf_counter() - start
        first = self._pick(logits, seq)
        new = stops.push(seq, [first])
        stats.ttft_s = time.perf_counter() - start
        if drafter is not None and not stops.finished:
            drafter.begin(seq)
        yield StreamEvent(stops.take_text(), new)

        while not stops.finished:
            if len(seq.token_ids) >= self.max_seq_len:
                stops.mark_length()
                break
            budget = min(draft_length.k, params.max_tokens - seq.num_generated - 1,
                         self.max_seq_len - len(seq.token_ids))
            t0 = time.perf_counter()
            proposal = drafter.propose(seq, budget) if drafter and budget > 0 else EMPTY_PROPOSAL
            t1 = time.perf_counter()
            result = self._verify(seq, proposal)
            stats.draft_s += t1 - t0
            stats.verify_s += time.perf_counter() - t1
            stats.target_steps += 1
            if proposal.k:
                stats.record_draft(proposal.k, result.num_accepted)
                draft_length.update(proposal.k, result.num_accepted)
            new = stops.push(seq, result.tokens)
            if drafter is not None and not stops.finished:
                t0 = time.perf_counter()
                drafter.accept(seq, result.num_accepted)
                stats.draft_s += time.perf_counter() - t0
            yield StreamEvent(stops.take_text(), new)

        stats.completion_tokens = seq.num_generated
        stats.total_s = time.perf_counter() - start
        output = GenerationOutput(
            text=stops.text,
            token_ids=seq.token_ids[seq.prompt_len :],
            finish_reason=stops.finish_reason,
            prompt_token_ids=list(prompt_ids),
            method=drafter.name if drafter is not None else "none",
            stats=stats,
        )
        yield StreamEvent(stops.take_text(final=True), [], output)

    def generate(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter | None,
                 k: int, adaptive: bool = True) -> GenerationOutput:
        for event in self.stream(prompt_ids, params, drafter, k, adaptive):
            if event.output is not None:
                return event.output
        raise RuntimeError("engine stream ended without an output")  # unreachable

    def _verify(self, seq: SequenceState, proposal: DraftProposal) -> VerifyResult:
        """Score the last committed token plus the drafts in one target forward, keep the valid
        prefix and one more token, and trim the rejected drafts from the cache."""
        inputs = torch.cat([torch.tensor(seq.token_ids[-1:]), proposal.tokens])
        logits = self.target.forward(inputs, self.cache)  # [K+1, V]
        if seq.params.greedy:
            result = verify_greedy(proposal.tokens, logits)
        else:
            probs = logits_to_probs(logits, seq.params)
            result = verify_rejection(proposal.tokens, proposal.probs, probs, seq.generator)
        self.cache.trim(proposal.k - result.num_accepted)
        return result

    @staticmethod
    def _pick(logits: Tensor, seq: SequenceState) -> int:
        """One token from target logits [1, V] by the request's sampling rule."""
        if seq.params.greedy:
            return int(greedy(logits)[0])
        return int(sample(logits_to_probs(logits, seq.params), seq.generator)[0])
