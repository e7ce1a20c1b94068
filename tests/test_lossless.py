"""Every drafter reproduces plain greedy decoding token for token (tiny random models)."""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.generation import GenerationOutput
from tests.conftest import spec_k
from tests.methods import SPEC_METHODS, RandomK

SEEDS = range(6)


def _prompt(seed: int) -> str:
    rng = random.Random(seed)
    words = ["def", "f(x)", "return", "x", "+", "1", "\n", "class", "A", ":", "self"]
    body = " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))
    return body + " " + body[: rng.randint(1, 12)]  # repeated spans give n-gram matches


@pytest.fixture(scope="module")
def llm(tiny_pair, tiny_pair_heads):
    target, draft = tiny_pair
    return LLM(model=str(target), draft=str(draft), max_seq_len=512, progress=False, **tiny_pair_heads)


@pytest.fixture(scope="module")
def plain(llm) -> Callable[[int], GenerationOutput]:
    """Plain greedy decoding of ``_prompt(seed)``: every method's baseline, decoded once per seed."""
    return functools.cache(lambda seed: llm.generate(_prompt(seed), _greedy(), method="none")[0])


@pytest.fixture(scope="module")
def self_draft_llm(tiny_pair):
    target, _ = tiny_pair
    return LLM(model=str(target), draft=str(target), max_seq_len=512, progress=False,
               draft_quantize="none")  # an exact copy of the target: every draft is accepted


def _greedy(n: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 4, 8])  # the policy chooses the Ks between them
@pytest.mark.parametrize("method", SPEC_METHODS)
def test_greedy_identity(llm, plain, method, k):
    drafted = 0
    for seed in SEEDS:
        prompt = _prompt(seed)
        # The policy's K (which may be 0 where drafts cannot pay), then K every step.
        for adaptive in (True, False):
            spec = llm.generate(prompt, _greedy(), method=method, num_speculative_tokens=k, adaptive=adaptive)[0]
            assert spec.token_ids == plain(seed).token_ids, (method, k, seed, adaptive)
            assert spec.text == plain(seed).text
            drafted += spec.stats.draft_tokens
            assert spec.stats.accepted_tokens <= spec.stats.draft_tokens
    assert drafted > 0, "the drafter never proposed anything: the test would prove nothing"


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_greedy_identity_while_k_and_source_change_every_step(llm, plain, method, monkeypatch):
    """K (0 included) and the draft source drawn at random each step: the output never moves."""
    monkeypatch.setattr(llm.engine, "policy", RandomK(seed=len(method)))
    drafted = plain_steps = 0
    for seed in SEEDS:
        spec = llm.generate(_prompt(seed), _greedy(), method=method, num_speculative_tokens=6)[0]
        assert spec.token_ids == plain(seed).token_ids, (method, seed)
        drafted += spec.stats.draft_tokens
        plain_steps += spec.stats.plain_steps
    assert drafted > 0
    assert plain_steps > 0 or not llm.drafter(method).adapts_length  # K = 0 was drawn too


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_seeded_sampling_equals_plain_sampling_whatever_the_drafts(llm, method, monkeypatch):
    """Sampled tokens win races keyed by the seed and their position (sample/race.py), so a seeded
    request gives plain sampled decoding's tokens under every method, whatever K and source each
    step drew, alone or beside other requests."""
    monkeypatch.setattr(llm.engine, "policy", RandomK(seed=len(method) + 1))
    params = [SamplingParams(max_tokens=24, temperature=t, top_p=p, top_k=k, seed=seed)
              for seed, (t, p, k) in zip(SEEDS, [(0.8, 1.0, 0), (1.0, 0.9, 0), (0.7, 1.0, 8), (1.3, 0.95, 20)])]
    prompts = [_prompt(seed) for seed in SEEDS][: len(params)]
    drafted = 0
    for prompt, sampling in zip(prompts, params):
        plain = llm.generate(prompt, sampling, method="none")[0]
        spec = llm.generate(prompt, sampling, method=method, num_speculative_tokens=5)[0]
        assert spec.token_ids == plain.token_ids, (method, sampling)
        drafted += spec.stats.draft_tokens
    batched = llm.generate(prompts, params[1], method=method, num_speculative_tokens=5)  # one batch
    assert [o.token_ids for o in batched] == [llm.generate(p, params[1], method="none")[0].token_ids for p in prompts]
    assert drafted > 0


@pytest.fixture(scope="module")
def int8_llm(tiny_pair, tiny_pair_heads):
    target, draft = tiny_pair
    return LLM(model=str(target), draft=str(draft), max_seq_len=512, progress=False, quantize="int8",
               **tiny_pair_heads)


@pytest.fixture(scope="module")
def int8_plain(int8_llm) -> Callable[[int], GenerationOutput]:
    return functools.cache(lambda seed: int8_llm.generate(_prompt(seed), _greedy(), method="none")[0])


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_greedy_identity_with_an_int8_target(int8_llm, int8_plain, plain, method):
    """With ``quantize="int8"`` every method reproduces the int8 target's own plain decoding,
    which is a slightly different model from the float one."""
    differs = 0
    for seed in SEEDS:
        spec = int8_llm.generate(_prompt(seed), _greedy(), method=method, num_speculative_tokens=4)[0]
        assert spec.token_ids == int8_plain(seed).token_ids, (method, seed)
        differs += int8_plain(seed).token_ids != plain(seed).token_ids
    assert int8_llm.target.layers[0].qkv.q.dtype == torch.int8
    assert differs > 0, "the int8 target decoded exactly like the float one: was it quantized?"


def test_int8_target_needs_float32(tiny_pair):
    from specdecode.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="float32"):
        LLM(model=str(tiny_pair[0]), dtype="bfloat16", quantize="int8", progress=False)
    with pytest.raises(InvalidConfigError, match="quantize"):
        LLM(model=str(tiny_pair[0]), quantize="int4", progress=False)


def test_some_drafts_are_rejected_and_some_accepted(llm):
    stats = [llm.generate(_prompt(s), _greedy(), method="draft_model", num_speculative_tokens=4, adaptive=False)[0].stats
             for s in SEEDS]
    assert 0 < sum(s.accepted_tokens for s in stats) < sum(s.draft_tokens for s in stats)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_perfect_draft_accepts_everything(self_draft_llm, k):
    out = self_draft_llm.generate(_prompt(1), _greedy(33), method="draft_model", num_speculative_tokens=k,
                              adaptive=False)[0]  # a draft as dear as the target: the policy would not draft
    plain = self_draft_llm.generate(_prompt(1), _greedy(33), method="none")[0]
    assert out.token_ids == plain.token_ids
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.mean_acceptance_length == pytest.approx(1 + out.stats.accepted_tokens / out.stats.drafts)
    assert out.stats.target_steps < plain.stats.target_steps


@pytest.mark.parametrize("method", ["none", *SPEC_METHODS])
@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_is_exact(llm, method, max_tokens):
    out = llm.generate(_prompt(3), _greedy(max_tokens), method=method, num_speculative_tokens=4)[0]
    assert len(out.token_ids) == max_tokens
    assert out.finish_reason == "length"
    assert out.stats.completion_tokens == max_tokens


@pytest.mark.parametrize("method", ["none", *SPEC_METHODS])
def test_stream_equals_generate(llm, method):
    params = SamplingParams(max_tokens=30, stop=("x +",), ignore_eos=True)
    for seed in SEEDS:
        whole = llm.generate(_prompt(seed), params, method=method)[0].text
        assert "".join(llm.stream(_prompt(seed), params, method=method)) == whole


@pytest.mark.parametrize("method", ["none", "draft_model"])
def test_stop_string_cuts_output_like_plain_decoding(llm, method):
    plain = llm.generate(_prompt(2), _greedy(40), method="none")[0].text
    stop = plain[10:13]
    assert len(stop) == 3
    out = llm.generate(_prompt(2), SamplingParams(max_tokens=40, stop=(stop,), ignore_eos=True), method=method)[0]
    assert out.text == plain[: plain.index(stop)]
    assert out.finish_reason == "stop"


def test_eos_stops_generation(tiny_pair, tiny_pair_heads):
    from tests.conftest import EOS_ID

    target, draft = tiny_pair
    llm = LLM(model=str(target), draft=str(draft), max_seq_len=512, progress=False, **tiny_pair_heads)
    # Make EOS the most likely token everywhere: plain and speculative both stop right after it.
    head = llm.target.lm_head.clone()  # the loaded one is memory-mapped from the cache
    head[EOS_ID] = 0
    head[EOS_ID, 0] = 1e4
    llm.target.lm_head = head
    llm.target.norm = torch.ones_like(llm.target.norm)
    for method in ("none", *SPEC_METHODS):
        out = llm.generate("abc", SamplingParams(max_tokens=20), method=method)[0]
        assert out.finish_reason == "stop", method
        assert out.token_ids[-1] == EOS_ID


def test_bfloat16_greedy_identity(tiny_pair):
    target, draft = tiny_pair
    llm = LLM(model=str(target), draft=str(draft), dtype="bfloat16", max_seq_len=512, progress=False)
    for seed in SEEDS:
        plain = llm.generate(_prompt(seed), _greedy(), method="none")[0]
        for method in ("ngram", "draft_model", "tree"):
            spec = llm.generate(_prompt(seed), _greedy(), method=method, num_speculative_tokens=4)[0]
            assert spec.token_ids == plain.token_ids, (method, seed)


def test_combined_uses_both_drafters(llm, monkeypatch):
    """A repeated prompt gives copies at first; where nothing matches the draft model drafts."""
    drafter = llm.drafter("combined")
    used = {"copy": 0, "model": 0}
    offer = drafter.sources

    def counted(source):
        def draft(seq, k):
            used["model" if source.name == "draft_model" else "copy"] += 1
            return source.draft(seq, k)

        return dataclasses.replace(source, draft=draft)

    monkeypatch.setattr(drafter, "sources", lambda seq: tuple(counted(s) for s in offer(seq)))
    repeated = "def add(a, b):\n    return a + b\n" * 3
    plain = llm.generate(repeated, _greedy(30), method="none")[0]
    out = llm.generate(repeated, _greedy(30), method="combined", adaptive=False)[0]
    assert out.token_ids == plain.token_ids
    assert used["copy"] > 0 and used["model"] > 0, used


def test_draft_length_out_of_range_is_refused(llm):
    from specdecode.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError):
        llm.generate("abc", _greedy(4), method="ngram", num_speculative_tokens=100)


@pytest.mark.parametrize("window, ngram, candidates", [(1, 2, 1), (6, 4, 5), (3, 5, 0)])
def test_lookahead_settings_keep_identity(llm, plain, window, ngram, candidates):
    from specdecode.drafters.lookahead import LookaheadDrafter

    drafter = LookaheadDrafter(window, ngram, candidates)
    for seed in SEEDS:
        out = llm.engine.generate(llm.tokenizer.encode(_prompt(seed)), _greedy(), drafter, spec_k(8))
        assert out.token_ids == plain(seed).token_ids, (window, ngram, candidates, seed)
        assert out.stats.draft_tokens > 0


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_context_limit_is_exact(tiny_pair, tiny_pair_heads, method):
    """At a full context every method stops where plain decoding stops, with the same tokens (a
    step's drafts plus its extra token must fit; a tree is also cut to the cache's room)."""
    target, draft = tiny_pair
    llm = LLM(model=str(target), draft=str(draft), max_seq_len=60, progress=False, **tiny_pair_heads)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    prompt = "ab ab ab ab ab ab ab ab ab ab ab"
    plain = llm.generate(prompt, params, method="none")[0]
    out = llm.generate(prompt, params, method=method)[0]
    assert out.finish_reason == plain.finish_reason == "length"
    assert out.token_ids == plain.token_ids
    assert len(out.prompt_token_ids) + len(out.token_ids) == 60
