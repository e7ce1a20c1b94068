"""The engine: one target model, its prefix cache, grammar compiler and speculation policy.

A request runs as a batch of one through the step loop (``batch.py``), the same loop a server's
concurrent requests share, so solo and batched requests decode, draft and choose K alike. Every
request takes its KV cache from the engine's prefix cache (``models/prefix_cache.py``), which may
hold the start of its prompt, and hands it back when it ends. Several samples of one prompt
(``begin_samples``) take their caches together and share one prefill of it; several prompts
(``generate_many``) run as one batch, each starting as another ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property

from specdecode.config import SpecConfig
from specdecode.drafters.base import Drafter
from specdecode.engine.batch import Batch
from specdecode.engine.generation import Generation, GenerationOutput, StreamEvent
from specdecode.engine.policy import CostModel, SpeculationPolicy
from specdecode.models.prefix_cache import PrefixCache, default_memory
from specdecode.errors import InvalidSamplingParamsError, KVCacheFullError, PromptTooLongError
from specdecode.models.cache import KVCache
from specdecode.models.decoder import Decoder
from specdecode.params import SamplingParams
from specdecode.sample.grammar import GrammarCompiler
from specdecode.tokenizer import Tokenizer

PLAIN = SpecConfig()  # the default settings; with no drafter, decoding is plain
# Requests ``generate_many`` runs at once: on 2 cores a step of 8 rows costs about 2-3 one-row
# steps (docs/GGUF_NATIVE.md), so a batch of 8 gives about 3x the tokens a second of one by one.
MAX_BATCH = 8


class Engine:
    """Runs requests against one target model, their KV caches taken from one prefix cache.

    ``policy``: the speculation policy, one per engine so what it measures (step costs, each
    method's acceptance) carries over from request to request; a server's batch shares it.
    ``prefix_cache``: whether finished requests' caches are kept for later prompts that start
    alike; ``kv_cache_memory``: the bytes all requests' caches may take, running and kept
    (default: ``prefix_cache.default_memory()``, a share of the machine's memory).
    """

    def __init__(self, target: Decoder, tokenizer: Tokenizer, max_seq_len: int, prefix_cache: bool = True,
                 kv_cache_memory: int | None = None) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.max_seq_len = min(max_seq_len, target.max_context)
        self.caches = PrefixCache(target.new_cache, kv_cache_memory or default_memory(), enabled=prefix_cache)
        self.grammars = GrammarCompiler(tokenizer, target.config.vocab_size)
        self.policy: SpeculationPolicy = CostModel()

    @cached_property
    def cache(self) -> KVCache:
        """A scratch cache of the whole context for tools that time raw forwards (allocated on
        first use, outside the budget); requests never use it."""
        return self.target.new_cache(self.max_seq_len)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise PromptTooLongError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.max_seq_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens but the context holds {self.max_seq_len} "
                "including at least one new token; shorten the prompt or raise max_seq_len"
            )

    def check_params(self, params: SamplingParams) -> None:
        """What ``SamplingParams`` cannot check alone: its logit bias names tokens of this vocabulary."""
        vocab = self.target.config.vocab_size
        outside = [token for token, _ in params.logit_bias or () if token >= vocab]
        if outside:
            raise InvalidSamplingParamsError(f"logit_bias names token id {outside[0]}, outside the vocabulary "
                                             f"[0, {vocab})")

    def begin(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter | None = None,
              spec: SpecConfig = PLAIN, cache: KVCache | None = None, *, fresh: bool = False) -> Generation:
        """A checked new request on ``cache`` (default: one from the prefix cache, which may hold
        the start of the prompt; it raises ``KVCacheFullError`` when the budget is spent; with
        ``fresh``, an empty one, for a request that will copy its prompt from another's prefill).
        ``drafter`` None is plain decoding; ``spec`` gives the draft length (K, and whether the
        policy may choose less: ``policy.py``); its method was already used to build ``drafter``.

        A drafter that reads the target's hidden states of every prompt token (an EAGLE head)
        gets a full prefill: a cached prefix carries keys and values, not hidden states."""
        self.check_prompt(prompt_ids)
        self.check_params(params)
        grammar = None if params.constraint is None else self.grammars.matcher(params.constraint)
        if cache is not None:
            return Generation(prompt_ids, params, drafter, spec, self.tokenizer, cache, self.max_seq_len, grammar)
        reuse = not fresh and (drafter is None or not drafter.needs_hidden_states)
        lease = self.caches.take(prompt_ids, min(self.max_seq_len, len(prompt_ids) + params.max_tokens), reuse)
        try:
            return Generation(prompt_ids, params, drafter, spec, self.tokenizer, lease.cache, self.max_seq_len,
                              grammar, lease.cached)
        except BaseException:
            self.caches.discard(lease.cache)
            raise

    def begin_samples(self, prompt_ids: list[int], params: Sequence[SamplingParams],
                      drafters: Sequence[Drafter | None], spec: SpecConfig = PLAIN) -> list[Generation]:
        """Requests for several samples of one prompt, one per ``params`` (each with its own
        drafter), all or none: every cache is taken now, so the memory budget counts them all
        and ``KVCacheFullError`` frees those already taken. The first takes its cache as
        ``begin`` does (a cached prefix included); the others get empty caches, to be filled
        from the first one's prefill (``Batch.add(..., shares=first)``)."""
        gens: list[Generation] = []
        try:
            for i, (p, drafter) in enumerate(zip(params, drafters, strict=True)):
                gens.append(self.begin(prompt_ids, p, drafter, spec, fresh=i > 0))
        except BaseException:
            for gen in gens:
                self.caches.discard(gen.cache)
            raise
        return gens

    def stream(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter | None = None,
               spec: SpecConfig = PLAIN) -> Iterator[StreamEvent]:
        """Generate for one prompt, yielding each step's newly final text (arguments as ``begin``):
        a batch of one, through the same step loop and policy as a server's requests."""
        for _, event in self._run(prompt_ids, [params], [drafter], spec):
            yield event

    def generate_samples(self, prompt_ids: list[int], params: Sequence[SamplingParams],
                         drafters: Sequence[Drafter | None], spec: SpecConfig = PLAIN) -> list[GenerationOutput]:
        """One output per ``params``, all samples of ``prompt_ids`` decoded together in one batch
        on one prefill of the prompt (see ``begin_samples``)."""
        return _outputs(self._run(prompt_ids, params, drafters, spec), len(params))

    def _run(self, prompt_ids: list[int], params: Sequence[SamplingParams], drafters: Sequence[Drafter | None],
             spec: SpecConfig) -> Iterator[tuple[int, StreamEvent]]:
        """The events of samples of one prompt, each with its index in ``params``; the first error
        any of them meets is raised."""
        batch = Batch(self.target, self.policy, caches=self.caches)
        gens = self.begin_samples(prompt_ids, params, drafters, spec)
        first = batch.add(gens[0], 0)
        for i, gen in enumerate(gens[1:], 1):
            batch.add(gen, i, shares=first)
        yield from _drive(batch)

    def generate_many(self, prompts: Sequence[list[int]], params: SamplingParams,
                      new_drafter: Callable[[list[int]], Drafter | None], spec: SpecConfig = PLAIN,
                      max_batch: int = MAX_BATCH) -> list[GenerationOutput]:
        """One output per prompt, the prompts decoded together in one batch of at most
        ``max_batch`` running requests, in order: each that ends makes room for the next, as a
        server's would. ``new_drafter(prompt_ids)`` gives each request its own drafter when it
        starts. A request waits for room in the memory budget while others run; alone and still
        too big, it raises ``KVCacheFullError``. The outputs are those of one ``generate`` per
        prompt (the kernels are row-invariant; a seeded sample's keys are its seed and position),
        except the timings."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        batch = Batch(self.target, self.policy, caches=self.caches)
        # (index, prompt, its drafter in a 1-tuple once made: None is plain decoding's drafter)
        waiting: deque[tuple[int, list[int], tuple[Drafter | None] | None]] = deque(
            (i, ids, None) for i, ids in enumerate(prompts))

        def admit() -> None:
            while waiting and len(batch) < max_batch:
                i, ids, drafter = waiting.popleft()
                drafter = drafter or (new_drafter(ids),)  # made once, however long it waits
                try:
                    gen = self.begin(ids, params, drafter[0], spec)
                except KVCacheFullError:
                    if not len(batch):
                        raise
                    waiting.appendleft((i, ids, drafter))
                    return  # room comes when a running request ends
                batch.add(gen, i)

        return _outputs(_drive(batch, admit), len(prompts))

    def generate(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter | None = None,
                 spec: SpecConfig = PLAIN) -> GenerationOutput:
        for event in self.stream(prompt_ids, params, drafter, spec):
            if event.output is not None:
                return event.output
        raise RuntimeError("engine stream ended without an output")  # unreachable


def _drive(batch: Batch, admit: Callable[[], None] = lambda: None) -> Iterator[tuple[int, StreamEvent]]:
    """Step ``batch`` until it is empty, ``admit`` adding waiting requests before each step; yield
    each event with its request's tag and raise the first error any request meets. However it
    ends (done, an error, the caller stopping early), the running requests' caches are handed
    back, so none stays counted as running."""
    try:
        admit()
        while len(batch):
            outcome = batch.step()
            for member, event in outcome.events:
                yield member.tag, event
            for _, error in outcome.failed:
                raise error
            admit()
    finally:
        batch.drop_all(kept=True)


def _outputs(events: Iterator[tuple[int, StreamEvent]], count: int) -> list[GenerationOutput]:
    """The final output of each of ``count`` requests tagged 0..count-1, in tag order."""
    outputs = {tag: event.output for tag, event in events if event.output is not None}
    return [outputs[i] for i in range(count)]
