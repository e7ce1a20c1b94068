"""The prefix cache under memory pressure, over HTTP on loopback: a KV budget that holds about two
conversations, eight clients cycling through twenty conversations turn by turn. Nothing crashes,
every answer equals the same conversation's answer computed without any cache, a request that
finds no room beside the running ones waits for them (none is refused), and the evictions are
counted in ``/metrics`` (issue 32's memory-pressure goal, bounded to run in seconds)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from server_support import LiveServer, metric

from specdecode import LLM, SamplingParams
from specdecode.server.app import create_app
from specdecode.server.scheduler import Scheduler

MODEL = "tiny-pair"
CLIENTS, CONVERSATIONS, REQUESTS_PER_CLIENT, TURNS = 8, 20, 6, 4
MAX_TOKENS = 8
RETRIES = 200  # were a 503 kv_cache_full answered, a client would wait 20 ms and ask again


def _message(conversation: int, turn: int) -> str:
    return f"conversation {conversation}, turn {turn}: say {conversation * 7 + turn}"


@pytest.fixture(scope="module")
def pair_llms(tiny_pair) -> tuple[LLM, LLM]:
    target, draft = tiny_pair
    cold = LLM(model=str(target), draft=str(draft), method="draft_model", max_seq_len=512, progress=False,
               prefix_cache=False)
    # Two whole conversations: the target's share (the draft's kept caches take the other half)
    # holds two caches of a last turn's prompt and answer, so kept conversations are evicted all
    # the time and a request often waits for a running one to leave.
    slot = cold.engine.caches.slot_bytes
    llm = LLM(model=str(target), draft=str(draft), method="draft_model", max_seq_len=512, progress=False,
              kv_cache_memory=2 * 2 * 384 * slot)
    return llm, cold


def test_eight_clients_twenty_conversations_in_a_budget_of_two(pair_llms):
    llm, cold = pair_llms
    history: dict[int, list[dict[str, str]]] = {c: [] for c in range(CONVERSATIONS)}
    locks = {c: threading.Lock() for c in range(CONVERSATIONS)}
    answered: list[tuple[list[dict[str, str]], str]] = []  # (messages sent, answer) per turn
    refused, failures = [0], []
    scheduler = Scheduler(llm, max_concurrency=3)  # three running caches do not fit: one waits

    def client(index: int, live: LiveServer) -> None:
        for j in range(REQUESTS_PER_CLIENT):
            conversation = (index * 3 + j * 5) % CONVERSATIONS
            with locks[conversation]:
                turn = len(history[conversation]) // 2
                if turn >= TURNS:
                    continue
                messages = history[conversation] + [{"role": "user", "content": _message(conversation, turn)}]
                body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
                for _ in range(RETRIES):
                    status, reply = live.post("/v1/chat/completions", body)
                    if status != 503:
                        break
                    assert reply["error"]["code"] == "kv_cache_full", reply
                    refused[0] += 1
                    time.sleep(0.02)
                if status != 200:
                    failures.append((status, reply))
                    return
                answer = reply["choices"][0]["message"]["content"]
                answered.append((messages, answer))
                history[conversation] = messages + [{"role": "assistant", "content": answer}]

    try:
        with LiveServer(create_app(llm, scheduler, served_model_name=MODEL)) as live:
            threads = [threading.Thread(target=client, args=(i, live)) for i in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            assert not any(t.is_alive() for t in threads), "a client hung"
            status, _, _ = live.request("GET", "/health")
            samples = live.metrics()
    finally:
        scheduler.close()
    assert not failures, failures[:3]
    assert status == 200
    assert len(answered) == CLIENTS * REQUESTS_PER_CLIENT  # every request was a turn (none over TURNS)
    assert sum(len(h) // 2 >= 2 for h in history.values()) >= 5, "few conversations reached a second turn"
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for messages, answer in answered:
        assert cold.generate(cold.chat_prompt_ids(messages), greedy)[0].text == answer, messages
    assert metric(samples, "specdecode_prefix_cache_evictions_total") > 0
    assert metric(samples, "specdecode_prefix_cache_hits_total") > 0  # later turns still found their prefix
    assert llm.engine.caches.used <= llm.engine.caches.budget
    assert scheduler.memory_waits > 0  # requests waited for memory, in order, rather than failing
    assert refused[0] == 0


def test_a_request_waits_for_memory_and_later_ones_do_not_overtake_it(tiny_pair):
    """Budget of four cache blocks: A runs in two; B needs all four, so it waits for A rather
    than failing; C would fit beside A but queued after B, so it starts only once B is done."""
    llm = LLM(model=str(tiny_pair[0]), method="none", max_seq_len=512, progress=False)
    block_bytes = llm.engine.caches.block * llm.engine.caches.slot_bytes
    llm = LLM(model=str(tiny_pair[0]), method="none", max_seq_len=512, progress=False,
              kv_cache_memory=4 * block_bytes)
    prompt = llm.tokenizer.encode("hello there")
    sizes = {"A": 200, "B": 400, "C": 20}  # max_tokens: two blocks, four blocks, one block
    order: list[tuple[str, str]] = []

    async def run(scheduler: Scheduler) -> dict[str, int]:
        async def one(name: str) -> int:
            params = SamplingParams(max_tokens=sizes[name], temperature=0.0, ignore_eos=True)
            count = 0
            async for event in scheduler.submit(prompt, params):
                if not count:
                    order.append((name, "first"))
                count += len(event.token_ids)
            order.append((name, "last"))
            return count

        a = asyncio.ensure_future(one("A"))
        while not order:  # A runs before B and C arrive
            await asyncio.sleep(0.005)
        b = asyncio.ensure_future(one("B"))
        await asyncio.sleep(0.01)
        c = asyncio.ensure_future(one("C"))
        return dict(zip("ABC", await asyncio.gather(a, b, c)))

    scheduler = Scheduler(llm, max_concurrency=4)
    try:
        counts = asyncio.run(run(scheduler))
    finally:
        scheduler.close()
    assert counts == sizes
    assert order.index(("B", "first")) > order.index(("A", "last"))  # B waited for A's memory
    assert order.index(("C", "first")) > order.index(("B", "last"))  # C did not overtake B
    assert scheduler.memory_waits > 0
