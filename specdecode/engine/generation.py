"""The propose -> verify -> commit loop.

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

from specdecode.sample.grammar import GrammarCompiler, TokenGrammar, apply_mask
from specdecode.sample.logprobs import TokenLogprob, token_logprobs
from specdecode.sample.synthetic import verify_synthetic
from specdecode.sample.verify import verify
from specdecode.models.cache import KVCache
from specdecode.config import SpecConfig
from specdecode.params import MAX_SPECULATIVE_TOKENS, SamplingParams
from specdecode.engine.draft_length import DraftLength
from specdecode.drafters.base import Drafter
from specdecode.sequence import EMPTY_PROPOSAL, DraftProposal, SequenceState
from specdecode.errors import NonFiniteLogitsError, PromptTooLongError
from specdecode.models.decoder import Decoder, HiddenCapture
from specdecode.sample.sampling import greedy, logits_to_probs, sample
from specdecode.engine.stats import RequestStats
from specdecode.engine.stops import StopChecker
from specdecode.tokenizer import Tokenizer


@dataclass(slots=True)
class GenerationOutput:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_token_ids: list[int]
    method: str
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked


# Prompt tokens per prefill forward. A server runs other requests' decode steps between chunks, so
# a long prompt stalls them for one chunk rather than for its whole prefill (docs/SERVING.md, "Long
# prompts"); 256 rows keep the kernels at full speed.
PREFILL_CHUNK = 256
PLAIN = SpecConfig()  # the default settings; with no drafter, decoding is plain

@dataclass(frozen=True, slots=True)
class StreamEvent:
    text: str  # newly final text (never retracted)
    token_ids: list[int]  # tokens committed in this step
    output: GenerationOutput | None = None  # set on the last event
    logprobs: list[TokenLogprob] = field(default_factory=list)  # token_ids' logprobs, when asked


class Generation:
    """One request's decoding state, advanced one target forward at a time.

    The engine loop and the server's batch scheduler drive it the same way: run the target on
    each of ``prefill_chunks()`` in turn, pass the last one's logits to ``start``; then, until
    ``finished``, run the target
    on ``plan()`` (the last committed token plus this step's drafts) and pass the logits to
    ``commit``; then ``finish`` returns the last event. Who owns the forward decides whether it
    is shared with other requests; the token decisions here never depend on it.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter | None, spec: SpecConfig,
                 tokenizer: Tokenizer, cache: KVCache, max_seq_len: int, grammar: TokenGrammar | None = None) -> None:
        self.started = time.perf_counter()
        self.cache, self.drafter, self.max_seq_len = cache, drafter, max_seq_len
        self.stats = RequestStats(prompt_tokens=len(prompt_ids))
        gen = torch.Generator()
        gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        self.seq = SequenceState(list(prompt_ids), len(prompt_ids), params, gen, grammar)
        # A drafter may size its own proposals (a lookahead window's depth is not a draft length).
        self.draft_length = DraftLength(spec.num_speculative_tokens,
                                        spec.adaptive and (drafter is None or drafter.adapts_length))
        self.stops = StopChecker(tokenizer, params)
        self.synthetic = spec.synthetic_acceptance  # None: the exact rules (see sample/synthetic.py)
        self.proposal = EMPTY_PROPOSAL
        self.k_cap: int | None = None  # a per-step limit on K set by the server under load (None: none)
        self.grammar = grammar  # structured output: masks every position (sample/grammar.py)
        self.forced_step = False  # this step's drafts are tokens the grammar forced, not the drafter's
        self.pruned = False  # the grammar cut some of this step's drafts
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # What every target forward of this request captures for the drafter (None: nothing).
        self.capture = (HiddenCapture(drafter.hidden_layers)
                        if drafter is not None and drafter.needs_hidden_states else None)
        cache.reset()

    @property
    def finished(self) -> bool:
        return self.stops.finished

    def prefill_chunks(self) -> list[Tensor]:
        """The prompt in forwards of at most ``PREFILL_CHUNK`` tokens, to run in order.

        Every path (the engine loop, the server) prefills in these same chunks, so a prompt gets
        the same bits wherever it runs; and the server can run other requests' decode steps, or
        notice a cancelled request, between one chunk and the next.
        """
        ids = self.seq.token_ids
        return [torch.tensor(ids[s : s + PREFILL_CHUNK]) for s in range(0, len(ids), PREFILL_CHUNK)]

    def start(self, logits: Tensor) -> StreamEvent:
        """Take the prefill's last-row logits [1, V]: pick the first token, start the drafter."""
        _check_finite(logits)
        self.stats.prefill_s = time.perf_counter() - self.started
        if self.grammar is not None:
            logits = apply_mask(logits, self.grammar.mask().unsqueeze(0))
        new = self.stops.push(self.seq, [_pick(logits, self.seq)])
        self.stats.ttft_s = time.perf_counter() - self.started
        if self.drafter is not None and not self.finished:
            self.drafter.begin(self.seq)
            if self.capture is not None:
                self.drafter.observe_hidden(self.capture.take())
        return self._event(new, logits)

    def _event(self, new: list[int], rows: Tensor) -> StreamEvent:
        """The step's event for the committed tokens ``new``, chosen on ``rows`` (one per token);
        moves the grammar past them and records their logprobs."""
        if self.grammar is not None and not self.finished:
            self.grammar.advance(new)
        logprobs = []
        if self.logprobs is not None:
            logprobs = token_logprobs(rows, new, self.seq.params.logprobs or 0)
            self.logprobs += logprobs
        return StreamEvent(self.stops.take_text(), new, logprobs=logprobs)

    def draft_budget(self, capped: bool = True) -> int:
        """How many drafts the drafter may propose this step (0: none, the step is plain).

        Drafts plus the one token every step adds must fit ``max_tokens`` and the context, as in
        plain decoding; ``k_cap`` (set by a server under load) lowers K for this step only. A step
        whose drafts the grammar forces needs none from the drafter. ``capped=False``: what it
        could propose without ``k_cap`` (a server reads that to choose the cap).
        """
        return 0 if self._forced(self._budget(capped=False)).k else self._budget(capped)

    def _budget(self, capped: bool = True) -> int:
        """``capped=False``: without ``k_cap``, for the grammar's forced drafts, which are kept for
        sure and cost no draft forward, so they pay at any load."""
        seq, params = self.seq, self.seq.params
        k = self.draft_length.k if self.k_cap is None or not capped else min(self.draft_length.k, self.k_cap)
        return max(0, min(k, params.max_tokens - seq.num_generated - 1, self.max_seq_len - len(seq.token_ids) - 1))

    def _forced(self, budget: int) -> DraftProposal:
        """The tokens the grammar forces next (at most ``budget``), as a chain of point-mass drafts."""
        if self.grammar is None or not budget:
            return EMPTY_PROPOSAL
        forced = self.grammar.forced()[:budget]
        return DraftProposal(torch.tensor(forced, dtype=torch.long), None) if forced else EMPTY_PROPOSAL

    def plan(self, proposal: DraftProposal | None = None) -> Tensor | None:
        """Draft this step; return the verify inputs (last token + drafts), or None when the
        context is full (the request then finishes with ``length``).

        ``proposal``: drafts already made for this step by a caller that drafted for several
        requests at once (at most ``draft_budget()`` of them); None asks the drafter here.
        """
        seq = self.seq
        if len(seq.token_ids) >= self.max_seq_len:
            self.stops.mark_length()
            return None
        t0 = time.perf_counter()
        budget = self._budget()
        forced = self._forced(self._budget(capped=False))
        self.forced_step = bool(forced.k)
        if forced.k:  # the grammar's own drafts: the drafter sits this step out
            proposal = forced
        elif proposal is None:
            proposal = self.drafter.propose(seq, budget) if self.drafter and budget > 0 else EMPTY_PROPOSAL
        self.pruned = False
        if self.grammar is not None:
            drafted, proposal = proposal.k, self.grammar.prune(proposal)
            self.pruned = proposal.k < drafted
        # A tree may hold more nodes than its depth: keep it within the cache and the widest
        # verify call the invariant kernels serve.
        room = min(MAX_SPECULATIVE_TOKENS, self.cache.capacity - self.cache.length - 1)
        self.proposal = proposal.truncated(room)
        self.stats.draft_s += time.perf_counter() - t0
        return torch.cat([torch.tensor(seq.token_ids[-1:]), self.proposal.tokens])

    @property
    def tree(self) -> list[int] | None:
        """The verify rows' parent rows when this step's drafts form a tree (None for a chain)."""
        if not self.proposal.is_tree:
            return None
        return [-1] + [p + 1 for p in self.proposal.parents]

    def commit(self, logits: Tensor, forward_s: float = 0.0) -> StreamEvent:
        """Take the verify logits [K+1, V]: keep the valid draft prefix and one more token, trim
        the rejected drafts from the cache, tell the drafter. ``forward_s``: the forward's time."""
        _check_finite(logits)
        seq, proposal, stats = self.seq, self.proposal, self.stats
        if self.grammar is not None:
            logits = apply_mask(logits, self.grammar.row_masks(proposal))
        if self.synthetic is not None and proposal.k:
            result = verify_synthetic(proposal, logits, seq.params, self.synthetic, seq.generator)
        else:
            result = verify(proposal, logits, seq.params, seq.generator)
        self.cache.commit(result, proposal.k + 1)
        stats.verify_s += forward_s
        stats.target_steps += 1
        if proposal.k and not self.forced_step:  # the drafter's acceptance, not the grammar's
            stats.record_draft(proposal.k, result.num_accepted, proposal.depth)
            self.draft_length.update(proposal.depth, result.num_accepted)
        new = self.stops.push(seq, result.tokens)
        kept = result.rows if result.rows is not None else list(range(result.num_accepted + 1))
        if self.drafter is not None and not self.finished:
            t0 = time.perf_counter()
            if not self.forced_step and not self.pruned:  # rows as the drafter proposed them
                self.drafter.observe(logits)
            if self.capture is not None:
                self.drafter.observe_hidden(self.capture.take()[kept])
            # After a forced step the drafter kept none of its own drafts (it made none) and
            # catches up on the committed tokens at its next propose, as after a step without drafts.
            self.drafter.accept(seq, 0 if self.forced_step else result.num_accepted)
            stats.draft_s += time.perf_counter() - t0
        return self._event(new, logits[kept])

    def finish(self) -> StreamEvent:
        """The last event, carrying the whole output and its stats."""
        if self.drafter is not None:
            self.drafter.finish(self.seq)
        self.stats.completion_tokens = self.seq.num_generated
        self.stats.total_s = time.perf_counter() - self.started
        output = GenerationOutput(
            text=self.stops.text,
            token_ids=self.seq.token_ids[self.seq.prompt_len :],
            finish_reason=self.stops.finish_reason,
            logprobs=self.logprobs,
            prompt_token_ids=self.seq.token_ids[: self.seq.prompt_len],
            method=self.drafter.name if self.drafter is not None else "none",
            stats=self.stats,
        )
        return StreamEvent(self.stops.take_text(final=True), [], output)


class Engine:
    """Runs requests one at a time against one target model, reusing one preallocated KV cache."""

    def __init__(self, target: Decoder, tokenizer: Tokenizer, max_seq_len: int) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.max_seq_len = min(max_seq_len, target.max_context)
        self.cache = target.new_cache(self.max_seq_len)
        self.grammars = GrammarCompiler(tokenizer, target.config.vocab_size)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise PromptTooLongError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.max_seq_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens but the context holds {self.max_seq_len} "
                "including at least one new token; shorten the prompt or raise max_seq_len"
            )

    def begin(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter | None = None,
              spec: SpecConfig = PLAIN, cache: KVCache | None = None) -> Generation:
        """A checked new request on ``cache`` (default: the engine's own). ``drafter`` None is
        plain decoding; ``spec`` gives the draft length (K, and whether it adapts to acceptance:
        ``draft_length.py``); its method was already used to build ``drafter``."""
        self.check_prompt(prompt_ids)
        grammar = None if params.constraint is None else self.grammars.matcher(params.constraint)
        return Generation(prompt_ids, params, drafter, spec, self.tokenizer,
                          cache if cache is not None else self.cache, self.max_seq_len, grammar)

    def stream(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter | None = None,
               spec: SpecConfig = PLAIN) -> Iterator[StreamEvent]:
        """Generate for one prompt, yielding each step's newly final text (arguments as ``begin``)."""
        gen = self.begin(prompt_ids, params, drafter, spec)
        for chunk in gen.prefill_chunks():
            logits = self.target.forward(chunk, self.cache, last_only=True, capture=gen.capture)
        yield gen.start(logits)
        while not gen.finished:
            inputs = gen.plan()
            if inputs is None:
                break
            t0 = time.perf_counter()
            logits = self.target.forward(inputs, self.cache, tree=gen.tree, capture=gen.capture)  # [K+1, V]
            yield gen.commit(logits, time.perf_counter() - t0)
        yield gen.finish()

    def generate(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter | None = None,
                 spec: SpecConfig = PLAIN) -> GenerationOutput:
        for event in self.stream(prompt_ids, params, drafter, spec):
            if event.output is not None:
                return event.output
        raise RuntimeError("engine stream ended without an output")  # unreachable


def _check_finite(logits: Tensor) -> None:
    """Refuse NaN or infinite logits (damaged weights): argmax would quietly turn them into token 0."""
    if not torch.isfinite(logits).all():
        raise NonFiniteLogitsError("the model produced NaN or infinite logits; its weights may be damaged: "
                                   "re-install or re-convert the model (e.g. `specdecode models pull NAME`)")


def _pick(logits: Tensor, seq: SequenceState) -> int:
    """One token from target logits [1, V] by the request's sampling rule."""
    if seq.params.greedy:
        return int(greedy(logits)[0])
    return int(sample(logits_to_probs(logits, seq.params), seq.generator)[0])
