"""Several samples of one prompt (OpenAI's ``n`` and ``best_of``), by vLLM's rules.

Seeds: sample i of a request seeded ``s`` takes seed ``s + i`` (vLLM's
``ParentRequest._get_child_sampling_params``), so each sample is reproducible alone: it equals a
single request with that seed. Without a seed every sample draws its own. ``s + i`` past the
largest seed wraps modulo 2**64, which is how torch's generator and the race keys read a seed.

``best_of``: that many samples are generated and the ``n`` whose tokens have the highest
cumulative log-probability are kept, highest first (vLLM's rule; ties keep the lower index).
Ranking needs every sampled token's logprob, so the candidates compute them
(``SamplingParams(logprobs=0)`` when the caller asked for none) and the kept outputs drop them
again. Without ``best_of`` the samples come back in index order.

The samples decode together and share one prefill of the prompt (``Engine.begin_samples``,
``Batch.add(..., shares=...)``).
"""

from __future__ import annotations

import dataclasses
import math

from specdecode.engine.generation import GenerationOutput
from specdecode.errors import InvalidSamplingParamsError
from specdecode.params import MAX_SAMPLES, SEED_MAX, SamplingParams


def sample_params(params: SamplingParams, count: int, ranked: bool = False) -> list[SamplingParams]:
    """The settings of ``count`` samples of one prompt: ``params`` with sample i's seed; with
    ``ranked`` (``best_of``), logprobs on so the samples can be ranked."""
    if not isinstance(count, int) or not 1 <= count <= MAX_SAMPLES:
        raise InvalidSamplingParamsError(f"the number of samples must be an integer in [1, {MAX_SAMPLES}], "
                                         f"got {count!r}")
    if ranked and params.logprobs is None:
        params = dataclasses.replace(params, logprobs=0)
    return [params if params.seed is None else dataclasses.replace(params, seed=child_seed(params.seed, i))
            for i in range(count)]


def child_seed(seed: int, i: int) -> int:
    """Sample i's seed: ``seed + i``, wrapped into the seeds torch takes (mod 2**64)."""
    child = seed + i
    return child - 2**64 if child > SEED_MAX else child


def cumulative_logprob(output: GenerationOutput) -> float:
    """The sum of the sampled tokens' log-probabilities (``output`` must carry logprobs)."""
    if output.logprobs is None:
        raise ValueError("ranking samples needs their logprobs")
    return math.fsum(lp.logprob for lp in output.logprobs)


def best(outputs: list[GenerationOutput], n: int, keep_logprobs: bool) -> list[GenerationOutput]:
    """The ``n`` outputs with the highest cumulative logprob, highest first; their logprobs
    dropped unless ``keep_logprobs`` (the caller asked for them)."""
    ranked = sorted(range(len(outputs)), key=lambda i: -cumulative_logprob(outputs[i]))[:n]
    kept = [outputs[i] for i in ranked]
    return kept if keep_logprobs else [dataclasses.replace(o, logprobs=None) for o in kept]
