"""The batch scheduler: concurrent requests share target forwards and still get their solo output."""

from __future__ import annotations

import asyncio

import pytest

from specdecode.api import LLM
from specdecode.params import SamplingParams
from specdecode.errors import PromptTooLongError, ServerBusyError
from specdecode.server.scheduler import Scheduler
from tests.conftest import spec_k
from tests.methods import SPEC_METHODS


@pytest.fixture(scope="module")
def llm(tiny_pair, tiny_pair_heads):
    target, draft = tiny_pair
    return LLM(model=str(target), draft=str(draft), method="draft_model", num_speculative_tokens=4,
               max_seq_len=256, progress=False, **tiny_pair_heads)


def _prompts(llm: LLM, n: int) -> list[list[int]]:
    return [llm.tokenizer.encode(f"def f{i}(x):\n    return x * {i} + " * (1 + i % 3)) for i in range(n)]


async def _collect(scheduler: Scheduler, ids: list[int], params: SamplingParams):
    job = scheduler.submit(ids, params)
    text, final = [], None
    async for event in job:
        text.append(event.text)
        if event.output is not None:
            final = event.output
    return "".join(text), final


def _run_concurrently(scheduler: Scheduler, prompts, params):
    """All requests at once through ``scheduler``; closes it afterwards."""

    async def run_all():
        return await asyncio.gather(*(_collect(scheduler, p, q) for p, q in zip(prompts, params)))

    try:
        return asyncio.run(run_all())
    finally:
        scheduler.close()


@pytest.mark.parametrize("method", ["none", *SPEC_METHODS])
def test_concurrent_requests_equal_solo_greedy(llm, method):
    prompts = _prompts(llm, 6)
    params = [SamplingParams(max_tokens=12 + 5 * i, ignore_eos=True) for i in range(6)]
    solo = [llm.engine.generate(p, q, llm.drafter(method), spec_k(4)) for p, q in zip(prompts, params)]
    scheduler = Scheduler(llm, method=method, max_concurrency=4, max_queue=8)
    results = _run_concurrently(scheduler, prompts, params)
    for (text, out), alone in zip(results, solo):
        assert out.token_ids == alone.token_ids
        assert text == out.text == alone.text
    assert scheduler.running == 0 and scheduler.waiting == 0


@pytest.mark.parametrize("method", ["none", "draft_model"])
def test_int8_target_batched_equals_solo(tiny_pair, method):
    """The int8 target's batched forward takes the invariant int8 kernel for every row count."""
    target, draft = tiny_pair
    llm = LLM(model=str(target), draft=str(draft), max_seq_len=256, progress=False, quantize="int8")
    prompts = _prompts(llm, 5)
    params = [SamplingParams(max_tokens=10 + 4 * i, ignore_eos=True) for i in range(5)]
    solo = [llm.engine.generate(p, q, llm.drafter(method), spec_k(4)) for p, q in zip(prompts, params)]
    results = _run_concurrently(Scheduler(llm, method=method, max_concurrency=5, max_queue=8), prompts, params)
    assert [out.token_ids for _, out in results] == [alone.token_ids for alone in solo]


def test_queue_full_raises_and_errors_reach_the_request(llm):
    scheduler = Scheduler(llm, method="ngram", max_concurrency=1, max_queue=0)
    prompt = _prompts(llm, 1)[0]

    async def scenario():
        long_job = scheduler.submit(prompt, SamplingParams(max_tokens=60, ignore_eos=True))
        with pytest.raises(ServerBusyError):
            scheduler.submit(prompt, SamplingParams(max_tokens=2))
        with pytest.raises(PromptTooLongError):
            scheduler.submit(list(range(300)), SamplingParams(max_tokens=2))
        long_job.cancel()
        async for _ in long_job:
            pass
        for _ in range(100):  # the worker drops the cancelled job at its next step
            if scheduler.running == 0:
                break
            await asyncio.sleep(0.01)
        assert scheduler.running == 0
        text, out = await _collect(scheduler, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.token_ids) == 3

    try:
        asyncio.run(scenario())
    finally:
        scheduler.close()


def test_seeded_sampling_is_reproducible_under_batching(llm):
    prompts = _prompts(llm, 3)
    params = [SamplingParams(max_tokens=15, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True)
              for i in range(3)]
    solo = [llm.engine.generate(p, q, llm.drafter("draft_model"), spec_k(4)) for p, q in zip(prompts, params)]
    results = _run_concurrently(Scheduler(llm, method="draft_model", max_concurrency=3), prompts, params)
    assert [out.token_ids for _, out in results] == [alone.token_ids for alone in solo]


def test_abandoned_waiters_do_not_hold_queue_places(llm):
    scheduler = Scheduler(llm, method="ngram", max_concurrency=1, max_queue=1)
    prompt = _prompts(llm, 1)[0]

    async def scenario():
        running = scheduler.submit(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
        while scheduler.running == 0:  # the worker admits it
            await asyncio.sleep(0.005)
        waiter = scheduler.submit(prompt, SamplingParams(max_tokens=2))
        waiter.cancel()  # the client gave up while queued
        assert scheduler.waiting == 0
        again = scheduler.submit(prompt, SamplingParams(max_tokens=2, ignore_eos=True))  # not 429
        running.cancel()
        out = None
        async for event in again:
            out = event.output or out
        assert len(out.token_ids) == 2

    try:
        asyncio.run(scenario())
    finally:
        scheduler.close()


def test_worker_survives_a_closed_event_loop_and_close_ends_every_job(llm):
    scheduler = Scheduler(llm, method="none", max_concurrency=2, max_queue=4)
    prompt = _prompts(llm, 1)[0]

    async def abandon():  # submit, then let asyncio.run close the loop under the running job
        scheduler.submit(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
        await asyncio.sleep(0.05)

    asyncio.run(abandon())
    text, out = asyncio.run(_collect(scheduler, prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    assert len(out.token_ids) == 3 and scheduler.alive

    async def shut_down_mid_request():
        job = scheduler.submit(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, scheduler.close)
        events = [event async for event in job]
        assert all(event.output is None for event in events)  # ended without an output
        with pytest.raises(ServerBusyError):
            scheduler.submit(prompt, SamplingParams(max_tokens=2))

    asyncio.run(shut_down_mid_request())
    assert not scheduler.alive and scheduler.running == 0


def test_a_long_prompt_runs_in_chunks_between_other_requests_decode_steps(llm, monkeypatch):
    """While a long prompt is prefilled chunk by chunk, a running request keeps decoding; both
    still get their solo output."""
    from specdecode.engine import generation as engine

    monkeypatch.setattr(engine, "PREFILL_CHUNK", 8)
    target = llm.engine.target
    calls: list[str] = []
    forward, forward_batch = target.forward, target.forward_batch

    def logged_forward(tokens, cache, last_only=False, tree=None, capture=None, invariant=False):
        calls.append(f"prefill{len(tokens)}" if last_only else "other")
        return forward(tokens, cache, last_only, tree, capture, invariant)

    def logged_batch(segments, last_only=False, trees=None, captures=None, invariant=False):
        calls.append("decode" if not invariant else "prefill-rows")
        return forward_batch(segments, last_only, trees, captures, invariant)

    monkeypatch.setattr(target, "forward", logged_forward)
    monkeypatch.setattr(target, "forward_batch", logged_batch)
    short, long = [5, 6, 7], list(range(10, 74))  # 64 tokens: 8 chunks
    params = [SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)]
    solo = [llm.engine.generate(p, q) for p, q in zip((short, long), params)]
    llm.engine.caches.clear()  # the long prompt must run whole, not resume from its solo run
    calls.clear()
    scheduler = Scheduler(llm, method="none", max_concurrency=4, max_queue=8)

    async def run():
        events = aiter(scheduler.submit(short, params[0]))
        first = await anext(events)  # the short request is decoding when the long one arrives
        later = asyncio.ensure_future(_collect(scheduler, long, params[1]))
        rest = [event async for event in events]
        return ("".join(e.text for e in [first, *rest]), rest[-1].output), await later

    try:
        results = asyncio.run(run())
    finally:
        scheduler.close()
    for (_, out), alone in zip(results, solo):
        assert out.token_ids == alone.token_ids
    chunks = [i for i, c in enumerate(calls) if c == "prefill8"]
    assert len(chunks) == 8
    between = calls[chunks[0] : chunks[-1]]
    assert between.count("decode") >= 7  # a decode step after every chunk but the last


def test_a_request_cancelled_during_its_prefill_stops_at_the_next_chunk(llm, monkeypatch):
    from specdecode.engine import generation as engine

    monkeypatch.setattr(engine, "PREFILL_CHUNK", 4)
    target = llm.engine.target
    chunks_run = []
    forward = target.forward
    scheduler = Scheduler(llm, method="none", max_concurrency=2, max_queue=2)
    holder = {}
    llm.engine.caches.clear()  # the prompt runs whole, whatever earlier tests left cached

    def logged_forward(tokens, cache, last_only=False, tree=None, capture=None, invariant=False):
        chunks_run.append(len(tokens))
        if len(chunks_run) == 2:
            holder["job"].cancel()  # the client leaves while its prompt runs
        return forward(tokens, cache, last_only, tree, capture, invariant)

    monkeypatch.setattr(target, "forward", logged_forward)

    async def run():
        job = scheduler.submit(list(range(10, 50)), SamplingParams(max_tokens=5))  # 10 chunks
        holder["job"] = job
        return [event async for event in job]

    try:
        events = asyncio.run(run())
    finally:
        scheduler.close()
    assert events == [] and chunks_run == [4, 4]  # the other 8 chunks never ran
