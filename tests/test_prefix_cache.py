"""Prefix caching: a prompt that starts like an earlier request's prefills only the rest, with
bitwise the output of a cold start, inside a memory budget (specdecode/models/prefix_cache.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.generation import PREFILL_CHUNK
from specdecode.models.prefix_cache import PrefixCache, common_prefix, parse_memory
from specdecode.errors import InvalidConfigError, KVCacheFullError
from specdecode.models.cache import KVCache
from specdecode.server.scheduler import Scheduler
from tests.methods import SPEC_METHODS


def _load(tiny_pair, heads, **kw) -> LLM:
    target, draft = tiny_pair
    return LLM(model=str(target), draft=str(draft), max_seq_len=512, progress=False, **heads, **kw)


@pytest.fixture(scope="module")
def cached(tiny_pair, tiny_pair_heads) -> LLM:
    return _load(tiny_pair, tiny_pair_heads)


@pytest.fixture(scope="module")
def uncached(tiny_pair, tiny_pair_heads) -> LLM:
    return _load(tiny_pair, tiny_pair_heads, prefix_cache=False)


def _rows(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(llm: LLM, ids: list[int], cache: KVCache, start: int = 0) -> torch.Tensor:
    """Run ``ids[start:]`` after a cache holding ``ids[:start]``, in the engine's chunks."""
    logits = None
    for s in range(start, len(ids), PREFILL_CHUNK):
        logits = llm.target.forward(torch.tensor(ids[s : s + PREFILL_CHUNK]), cache, last_only=True, invariant=True)
    return logits


@pytest.mark.parametrize("split", [1, 37, 100, 255, 256, 257, 299])
def test_a_prefill_resumed_after_a_cached_prefix_equals_a_whole_prefill(uncached, split):
    """Keys, values and the last logits agree bit for bit wherever the cached prefix ends: inside
    the first chunk, on its boundary, or in the second (so the chunks start elsewhere)."""
    ids = _rows(300)
    whole = uncached.target.new_cache(512)
    want = _prefill(uncached, ids, whole)
    resumed = uncached.target.new_cache(512)
    _prefill(uncached, ids[:split], resumed)
    got = _prefill(uncached, ids, resumed, start=split)
    assert torch.equal(got, want)
    assert torch.equal(resumed.k[:, :, :300], whole.k[:, :, :300])
    assert torch.equal(resumed.v[:, :, :300], whole.v[:, :, :300])


def test_a_prefill_equals_feeding_the_prompt_token_by_token(uncached):
    """A cached conversation's answer was computed one decode row at a time: its rows must have a
    long prefill's bits."""
    ids = _rows(90, seed=1)
    whole = uncached.target.new_cache(128)
    want = _prefill(uncached, ids, whole)
    one = uncached.target.new_cache(128)
    for token in ids:
        got = uncached.target.forward(torch.tensor([token]), one)
    assert torch.equal(got, want)
    assert torch.equal(one.k[:, :, :90], whole.k[:, :, :90])


def _conversation(llm: LLM, method: str, params: SamplingParams, first: str, **settings):
    """Two turns: the second prompt is the first prompt, its answer and a new message."""
    one = llm.generate(first, params, method=method, **settings)[0]
    ids = one.prompt_token_ids + one.token_ids + llm.tokenizer.encode(" and then def g(y): return y")
    two = llm.generate(ids, params, method=method, **settings)[0]
    return one, two


def _turns_agree(a, b) -> None:
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.logprobs == y.logprobs


@pytest.mark.parametrize("method", ("none",) + SPEC_METHODS)
def test_two_turns_with_the_prefix_cache_equal_two_turns_without(cached, uncached, method):
    first = f"def f(x): return x + 1  # {method} " * 2
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    with_cache = _conversation(cached, method, greedy, first)
    _turns_agree(with_cache, _conversation(uncached, method, greedy, first))
    sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True, logprobs=1)
    _turns_agree(_conversation(cached, method, sampled, first), _conversation(uncached, method, sampled, first))
    drafter = cached.drafter(method)
    if drafter is not None and drafter.needs_hidden_states:  # reads every prompt row's hidden states
        assert with_cache[1].stats.cached_tokens == 0
    else:
        one = with_cache[0]
        assert with_cache[1].stats.cached_tokens == len(one.prompt_token_ids) + len(one.token_ids) - 1
    assert all(o.stats.cached_tokens == 0 for o in _conversation(uncached, method, greedy, first))


@pytest.mark.parametrize("method", ["draft_model", "tree"])
def test_the_draft_model_resumes_from_its_own_prefix_cache(cached, method, monkeypatch):
    """The next turn's draft cache starts from the last turn's: only the new tokens are fed."""
    drafter = cached.drafter(method)
    draft = getattr(drafter, "draft", drafter)  # tree wraps a DraftModelDrafter
    begun = []
    begin = type(draft).begin
    monkeypatch.setattr(draft, "begin", lambda seq: (begin(draft, seq), begun.append(draft._cached)))
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cached.clear_prefix_cache()
    one, two = _conversation(cached, method, greedy, f"class Draft{method}: pass  # " * 3, adaptive=False)
    assert begun[0] == 0 and begun[1] > len(one.prompt_token_ids) // 2
    assert cached.draft_prefixes.hits >= begun[1]


def test_the_same_prompt_again_reuses_all_but_its_last_token(cached):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = "class A: pass  # the same prompt twice"
    first = cached.generate(prompt, params, method="none")[0]
    again = cached.generate(prompt, params, method="none")[0]
    assert again.token_ids == first.token_ids
    assert again.stats.cached_tokens == len(first.prompt_token_ids) - 1


def test_concurrent_requests_sharing_a_prefix_stay_exact(cached, uncached):
    """A cached conversation, then two requests extending it at once in the server's batch: one
    takes the cached entry, the other starts cold or copies it; both equal the uncached output."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    base = cached.tokenizer.encode("shared system prompt: answer in code. " * 3)
    cached.generate(base, params, method="draft_model")
    prompts = [base + cached.tokenizer.encode(q) for q in (" first question?", " second one?")]

    async def run(scheduler: Scheduler):
        async def one(ids):
            async for event in scheduler.submit(ids, params):
                if event.output is not None:
                    return event.output
        return await asyncio.gather(*(one(p) for p in prompts))

    scheduler = Scheduler(cached, method="draft_model", max_concurrency=2)
    try:
        outputs = asyncio.run(run(scheduler))
    finally:
        scheduler.close()
    want = [uncached.generate(p, params, method="draft_model")[0].token_ids for p in prompts]
    assert [o.token_ids for o in outputs] == want
    assert sum(o.stats.cached_tokens for o in outputs) >= len(base) - 1


# --- the pool and its budget ----------------------------------------------------------------------


def _pool(budget_caches: float) -> PrefixCache:
    new_cache = lambda capacity: KVCache(1, 1, 4, -(-capacity // 8) * 8)  # noqa: E731 - blocks of 8 slots
    return PrefixCache(new_cache, int(budget_caches * 2 * 8 * 4 * 4))  # one 8-slot cache is 256 bytes


def _finish(pool: PrefixCache, ids: list[int], capacity: int = 8) -> KVCache:
    lease = pool.take(ids, capacity)
    lease.cache.length = len(ids)
    pool.release(lease.cache, ids)
    return lease.cache


def test_least_recently_used_idle_entries_are_evicted_first():
    pool = _pool(3)
    for first in (1, 2, 3):
        _finish(pool, [first, 9, 9])
    assert len(pool) == 3 and pool.used == pool.budget
    lease = pool.take([1, 9, 9, 5], 8)  # extends entry 1: taken whole, then back as the newest
    assert lease.cached == 3
    lease.cache.length = 4
    pool.release(lease.cache, [1, 9, 9, 5])
    _finish(pool, [4, 9])  # full: evicts the least recently used idle entry, 2
    assert pool.evictions == 1
    assert pool.take([3, 9, 9, 5], 8).cached == 3  # 3 survived; taken, it is running now
    assert pool.take([2, 9, 9, 5], 8).cached == 0  # 2 is gone; this cache evicts 1, never 3
    assert pool.evictions == 2 and len(pool) == 1 and pool.used == pool.budget
    assert pool.hits == 6 and pool.queries == 3 * 3 + 4 + 2 + 4 + 4


def test_running_caches_are_never_evicted_and_a_request_that_cannot_fit_is_refused():
    pool = _pool(2)
    a, b = pool.take([1, 2], 8), pool.take([3, 4], 8)
    with pytest.raises(KVCacheFullError, match="running requests hold"):
        pool.take([5, 6], 8)
    with pytest.raises(KVCacheFullError, match="more than the whole"):
        pool.take([5, 6], 24)
    a.cache.length = 2
    pool.release(a.cache, [1, 2])
    assert pool.take([5, 6], 8).cached == 0  # evicted the idle entry, never b
    assert pool.evictions == 1 and b.cache.length == 0 and len(pool) == 0


def test_a_branch_copies_the_shared_prefix_and_keeps_the_entry():
    pool = _pool(4)
    _finish(pool, [1, 2, 3, 4, 5, 6])
    branch = pool.take([1, 2, 7], 8)
    assert branch.cached == 2 and len(pool) == 1  # the entry still serves its own conversation
    assert pool.take([1, 2, 3, 4, 5, 6, 7], 8).cached == 6


def test_an_entry_too_small_for_the_request_is_copied_into_a_larger_cache():
    pool = _pool(4)
    small = _finish(pool, [1, 2, 3])
    small.k[0, 0, :3] = torch.arange(12.0).view(3, 4)
    grown = pool.take([1, 2, 3, 4], 20)
    assert grown.cached == 3 and grown.cache.capacity >= 20 and len(pool) == 0
    assert torch.equal(grown.cache.k[0, 0, :3], small.k[0, 0, :3])
    assert pool.used == 3 * 256


def test_a_request_with_no_room_beside_its_prefix_starts_cold_instead_of_failing():
    """The entry a branch would copy from takes one of two blocks, and the branch needs both: it
    evicts the entry and prefills whole rather than being refused."""
    pool = _pool(2)
    _finish(pool, [1, 2, 3, 4, 5, 6])
    lease = pool.take([1, 2, 7], 16)
    assert lease.cached == 0 and len(pool) == 0 and pool.evictions == 1 and pool.hits == 0


def test_a_kept_cache_shrinks_to_the_tokens_it_holds():
    pool = _pool(4)
    lease = pool.take([1, 2, 3], 32)
    lease.cache.k[0, 0, :3] = torch.arange(12.0).view(3, 4)
    lease.cache.length = 3
    pool.release(lease.cache, [1, 2, 3])
    assert pool.used == 256  # one block of 8 slots kept, not 32 slots
    again = pool.take([1, 2, 3, 4], 8)
    assert again.cached == 3 and again.cache.capacity == 8
    assert torch.equal(again.cache.k[0, 0, :3], torch.arange(12.0).view(3, 4))


def test_an_engine_over_its_budget_refuses_with_the_named_error(tiny_pair):
    llm = LLM(model=str(tiny_pair[0]), max_seq_len=512, progress=False, kv_cache_memory="4KiB")
    with pytest.raises(KVCacheFullError, match="kv-cache-memory"):
        llm.generate("hello", SamplingParams(max_tokens=4))
    assert llm.engine.caches.used == 0


def test_memory_sizes_parse():
    assert parse_memory("2GiB") == 2 * 2**30 and parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5GB") == 1_500_000_000 and parse_memory("4096") == 4096
    for bad in ("two gigs", "0", "-1GiB", "5XB"):
        with pytest.raises(InvalidConfigError):
            parse_memory(bad)


def test_common_prefix():
    t = lambda *v: torch.tensor(v)  # noqa: E731
    assert common_prefix(t(1, 2, 3), t(1, 2, 4)) == 2
    assert common_prefix(t(1, 2), t(1, 2, 4)) == 2 and common_prefix(t(5), t(1)) == 0


# --- the GGUF-native target (the default for catalog models) --------------------------------------

NATIVE_TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "ffn_down": "Q5_1", "output.weight": "Q6_K"}


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> LLM:
    from tests.gguf_blocks import write_model_gguf

    root = tmp_path_factory.mktemp("native-prefix")
    write_model_gguf(root / "target.gguf", NATIVE_TYPES, seed=5, inter=256)  # k-quant rows: 256 wide
    return LLM(model=str(root / "target.gguf"), method="suffix", max_seq_len=512, progress=False)


def _without_cache(llm: LLM, run):
    """``run()`` on ``llm`` with its prefix caches switched off (and emptied), then on again."""
    llm.clear_prefix_cache()
    pools = [p for p in (llm.engine.caches, llm.draft_prefixes) if p is not None]
    for pool in pools:
        pool.enabled = False
    try:
        return run()
    finally:
        for pool in pools:
            pool.enabled = True


def test_native_resumed_prefill_equals_a_whole_prefill(native):
    assert native.quantize == "native"
    ids = _rows(280, seed=2)
    whole = native.target.new_cache(512)
    want = _prefill(native, ids, whole)
    for split in (1, 100, 256, 270):
        resumed = native.target.new_cache(512)
        _prefill(native, ids[:split], resumed)
        assert torch.equal(_prefill(native, ids, resumed, start=split), want)


@pytest.mark.parametrize("method", ["none", "suffix"])
def test_native_two_turns_with_the_prefix_cache_equal_two_turns_without(native, method):
    first = f"def f(x): return x + 1  # {method}\n"
    for params in (SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
                   SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)):
        cold = _without_cache(native, lambda: _conversation(native, method, params, first))
        with_cache = _conversation(native, method, params, first)
        _turns_agree(with_cache, cold)
        assert with_cache[1].stats.cached_tokens > 0 and cold[1].stats.cached_tokens == 0


def test_int8_target_two_turns_with_the_prefix_cache_equal_two_turns_without(tiny_pair):
    llm = LLM(model=str(tiny_pair[0]), draft=str(tiny_pair[1]), max_seq_len=512, progress=False, quantize="int8")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    first = "def f(x): return x + 1  # an int8 target, long enough for a real prefill " * 2
    for method in ("none", "draft_model"):
        cold = _without_cache(llm, lambda: _conversation(llm, method, params, first))
        with_cache = _conversation(llm, method, params, first)
        _turns_agree(with_cache, cold)
        assert with_cache[1].stats.cached_tokens > 40
