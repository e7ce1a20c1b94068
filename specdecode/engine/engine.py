"""The engine: one target model, its KV cache, grammar compiler and speculation policy.

A request runs as a batch of one through the step loop (``batch.py``), the same loop a server's
concurrent requests share, so solo and batched requests decode, draft and choose K alike.
"""

from __future__ import annotations

from collections.abc import Iterator

from specdecode.config import SpecConfig
from specdecode.drafters.base import Drafter
from specdecode.engine.batch import Batch
from specdecode.engine.generation import Generation, GenerationOutput, StreamEvent
from specdecode.engine.policy import CostModel, SpeculationPolicy
from specdecode.errors import PromptTooLongError
from specdecode.models.cache import KVCache
from specdecode.models.decoder import Decoder
from specdecode.params import SamplingParams
from specdecode.sample.grammar import GrammarCompiler
from specdecode.tokenizer import Tokenizer

PLAIN = SpecConfig()  # the default settings; with no drafter, decoding is plain


class Engine:
    """Runs requests one at a time against one target model, reusing one preallocated KV cache.

    ``policy``: the speculation policy, one per engine so what it measures (step costs, each
    method's acceptance) carries over from request to request; a server's batch shares it.
    """

    def __init__(self, target: Decoder, tokenizer: Tokenizer, max_seq_len: int) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.max_seq_len = min(max_seq_len, target.max_context)
        self.cache = target.new_cache(self.max_seq_len)
        self.grammars = GrammarCompiler(tokenizer, target.config.vocab_size)
        self.policy: SpeculationPolicy = CostModel()

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
        plain decoding; ``spec`` gives the draft length (K, and whether the policy may choose less:
        ``policy.py``); its method was already used to build ``drafter``."""
        self.check_prompt(prompt_ids)
        grammar = None if params.constraint is None else self.grammars.matcher(params.constraint)
        return Generation(prompt_ids, params, drafter, spec, self.tokenizer,
                          cache if cache is not None else self.cache, self.max_seq_len, grammar)

    def stream(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter | None = None,
               spec: SpecConfig = PLAIN) -> Iterator[StreamEvent]:
        """Generate for one prompt, yielding each step's newly final text (arguments as ``begin``):
        a batch of one, through the same step loop and policy as a server's requests."""
        batch = Batch(self.target, self.policy)
        batch.add(self.begin(prompt_ids, params, drafter, spec))
        while len(batch):
            outcome = batch.step()
            for _, event in outcome.events:
                yield event
            for _, error in outcome.failed:
                raise error

    def generate(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter | None = None,
                 spec: SpecConfig = PLAIN) -> GenerationOutput:
        for event in self.stream(prompt_ids, params, drafter, spec):
            if event.output is not None:
                return event.output
        raise RuntimeError("engine stream ended without an output")  # unreachable
