"""Several samples of one prompt: OpenAI's ``n`` (chat and completions, streamed or not) and
``best_of`` (completions), and ``LLM.generate_n``.

Sample i of a seeded request is the single request with seed ``seed + i``; the samples prefill the
prompt once; ``best_of`` keeps the samples with the highest cumulative logprob; every method gives
the samples plain decoding gives.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket

import pytest
from server_support import LiveServer, SlowJobs, assert_openai_error, metric, read_until, sse_events, wait_until

from specdecode import LLM, SamplingParams
from specdecode.engine.samples import child_seed
from specdecode.params import SEED_MAX
from specdecode.server.app import create_app
from specdecode.server.scheduler import Scheduler
from tests.methods import SPEC_METHODS

MODEL = "tiny-pair"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tiny_pair, tiny_pair_heads) -> LLM:
    target, draft = tiny_pair
    # K fixed: the policy would rightly skip drafting on tiny random models, and these tests want drafts.
    return LLM(model=str(target), draft=str(draft), method="draft_model", num_speculative_tokens=4,
               adaptive=False, max_seq_len=256, progress=False, **tiny_pair_heads)


@pytest.fixture(scope="module")
def servers(llm):
    """A server per method, all on ``llm`` (its weights and prefix cache); draft_model first."""
    running = {}
    try:
        for method in ("draft_model", "none", "ngram"):
            scheduler = Scheduler(llm, method=method, max_concurrency=4, max_queue=16)
            server = LiveServer(create_app(llm, scheduler, served_model_name=MODEL)).__enter__()
            running[method] = (server, scheduler)
        yield {method: server for method, (server, _) in running.items()}
    finally:
        for server, scheduler in running.values():
            server.__exit__(None, None, None)
            scheduler.close()


@pytest.fixture(scope="module")
def live(servers) -> LiveServer:
    return servers["draft_model"]


def _body(path: str, prompt: str, **fields) -> dict:
    where = {"messages": [{"role": "user", "content": prompt}]} if path == CHAT else {"prompt": prompt}
    return {"model": MODEL, **where, **fields}


def _texts(path: str, body: dict) -> list[str]:
    return [c["message"]["content"] if path == CHAT else c["text"] for c in body["choices"]]


def _post_ok(server: LiveServer, path: str, body: dict) -> dict:
    status, got = server.post(path, body)
    assert status == 200, got
    return got


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_sample_i_is_the_single_request_with_seed_plus_i(live, path):
    body = _body(path, f"samples on {path}: def f(x):", max_tokens=12, seed=41, **SAMPLED)
    many = _post_ok(live, path, {**body, "n": 4})
    singles = [_post_ok(live, path, {**body, "seed": 41 + i}) for i in range(4)]
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    assert _texts(path, many) == [_texts(path, one)[0] for one in singles]
    assert len(set(_texts(path, many))) > 1  # sampled: the seeds differ
    usage = many["usage"]
    assert usage["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == sum(one["usage"]["completion_tokens"] for one in singles) == 4 * 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    stats = many["spec_decode"]  # over every sample
    assert stats["method"] == "draft_model" and stats["drafts"] > 0
    assert stats["mean_acceptance_length"] == pytest.approx(1 + stats["accepted_tokens"] / stats["drafts"])


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_stream_of_three_samples_reassembles_to_the_plain_response(live, path):
    body = _body(path, f"stream samples on {path}: x =", max_tokens=10, seed=7, n=3, **SAMPLED)
    plain = _post_ok(live, path, body)
    status, _, text = live.request("POST", path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    pieces, finishes, drafts = {0: "", 1: "", 2: ""}, {0: 0, 1: 0, 2: 0}, 0
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        piece = choice["delta"].get("content", "") if path == CHAT else choice["text"]
        pieces[choice["index"]] += piece
        finishes[choice["index"]] += choice["finish_reason"] is not None
        if choice["finish_reason"] is not None:  # with that sample's own statistics
            drafts += chunk["spec_decode"]["drafts"]
    if path == CHAT:  # each choice's role chunk comes first
        assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:3]] == [
            (i, {"role": "assistant", "content": ""}) for i in range(3)]
    assert [pieces[i] for i in range(3)] == _texts(path, plain)
    assert finishes == {0: 1, 1: 1, 2: 1}
    last = chunks[-1]  # the usage chunk, once, after every choice finished
    assert last["choices"] == [] and last["spec_decode"]["drafts"] == drafts
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert last["usage"][field] == plain["usage"][field]


def test_the_samples_prefill_the_prompt_once(live, llm, monkeypatch):
    rows = []
    forward = llm.target.forward

    def counting(inputs, cache, *args, invariant=False, **kwargs):
        if invariant:  # the step loop's prefill chunks
            rows.append(int(inputs.shape[0]))
        return forward(inputs, cache, *args, invariant=invariant, **kwargs)

    monkeypatch.setattr(llm.target, "forward", counting)
    body = _body(COMPLETIONS, "a prompt no request sent before, prefilled once for four samples:",
                 max_tokens=4, n=4, seed=3, **SAMPLED)
    got = _post_ok(live, COMPLETIONS, body)
    assert sum(rows) == got["usage"]["prompt_tokens"]  # not four times
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(live):
    body = _body(COMPLETIONS, "best of three: def g(y):", max_tokens=10, seed=19, **SAMPLED)
    singles = [_post_ok(live, COMPLETIONS, {**body, "seed": 19 + i, "logprobs": 0}) for i in range(3)]
    scores = [math.fsum(one["choices"][0]["logprobs"]["token_logprobs"]) for one in singles]
    ranked = sorted(range(3), key=lambda i: -scores[i])
    best = _post_ok(live, COMPLETIONS, {**body, "best_of": 3})
    assert len(best["choices"]) == 1 and best["choices"][0]["logprobs"] is None  # not asked for
    assert best["choices"][0]["text"] == singles[ranked[0]]["choices"][0]["text"]
    assert best["usage"]["completion_tokens"] == 3 * 10  # every candidate generated
    two = _post_ok(live, COMPLETIONS, {**body, "best_of": 3, "n": 2, "logprobs": 0})
    assert _texts(COMPLETIONS, two) == [singles[i]["choices"][0]["text"] for i in ranked[:2]]
    assert [c["logprobs"]["token_logprobs"] for c in two["choices"]] == [
        singles[i]["choices"][0]["logprobs"]["token_logprobs"] for i in ranked[:2]]


@pytest.mark.parametrize("path, fields, param", [
    (CHAT, {"n": 0}, "n"),
    (COMPLETIONS, {"n": 17}, "n"),
    (CHAT, {"n": 5}, "n"),  # more than the server's --max-concurrency 4
    (COMPLETIONS, {"n": 2, "best_of": 1}, "best_of"),
    (COMPLETIONS, {"best_of": 2, "stream": True}, "best_of"),
    (COMPLETIONS, {"best_of": 5}, "best_of"),
    (CHAT, {"best_of": 2}, "best_of"),  # a completions field only
])
def test_bad_sample_counts_are_400_naming_the_field(live, path, fields, param):
    status, got = live.post(path, _body(path, "x", max_tokens=2, **fields))
    assert assert_openai_error(status, got, 400)["param"] == param


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_every_method_gives_plain_decodings_samples(servers, method):
    body = _body(COMPLETIONS, "exact samples: for i in range(10):", max_tokens=16, seed=2024, n=3, **SAMPLED)
    plain = _post_ok(servers["none"], COMPLETIONS, body)
    spec = _post_ok(servers[method], COMPLETIONS, body)
    assert _texts(COMPLETIONS, spec) == _texts(COMPLETIONS, plain)
    assert spec["spec_decode"]["method"] == method and spec["spec_decode"]["drafts"] > 0


def test_samples_that_do_not_fit_the_kv_budget_fail_with_503_and_free_what_they_took(live, llm, monkeypatch):
    caches = llm.engine.caches
    body = _body(COMPLETIONS, "budget", max_tokens=40, seed=1, **SAMPLED)
    prompt_tokens = _post_ok(live, COMPLETIONS, body)["usage"]["prompt_tokens"]
    one = math.ceil((prompt_tokens + 40) / caches.block) * caches.block * caches.slot_bytes
    llm.clear_prefix_cache()
    monkeypatch.setattr(caches, "budget", int(2.5 * one))
    status, got = live.post(COMPLETIONS, {**body, "n": 3})
    assert assert_openai_error(status, got, 503)["code"] == "kv_cache_full"
    assert caches.used == 0  # the samples' caches were given back
    assert len(_post_ok(live, COMPLETIONS, {**body, "n": 2})["choices"]) == 2


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_every_sample(llm, stream):
    scheduler = Scheduler(llm, method="ngram", max_concurrency=3, max_queue=0)
    slow = SlowJobs(scheduler, delay=0.02)  # 3 x 250 events take seconds to reach the app
    body = _body(COMPLETIONS, "a", max_tokens=250, n=3, temperature=0, ignore_eos=True, stream=stream)
    try:
        with LiveServer(create_app(llm, slow, served_model_name=MODEL)) as server:
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                data = json.dumps(body).encode()
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
                if stream:
                    read_until(sock, b"data: ")
                else:
                    assert wait_until(lambda: slow.submitted == 3)
            assert wait_until(lambda: slow.cancels == 3)
            assert wait_until(lambda: scheduler.running == 0)
            assert metric(server.metrics(), "specdecode_requests_cancelled_total") == 3
            again = _post_ok(server, COMPLETIONS, {**body, "max_tokens": 3, "stream": False})
            assert [c["text"] for c in again["choices"]] == [again["choices"][0]["text"]] * 3  # greedy: alike
    finally:
        scheduler.close()


# --- the Python API --------------------------------------------------------------------------------


def test_generate_n_equals_generate_with_seed_plus_i_on_one_prefill(llm):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=SEED_MAX - 1, ignore_eos=True)
    prompt = "generate_n: class A:"
    outputs = llm.generate_n(prompt, params, 3)
    singles = [llm.generate(prompt, dataclasses.replace(params, seed=child_seed(params.seed, i)))[0]
               for i in range(3)]
    assert [o.token_ids for o in outputs] == [s.token_ids for s in singles]
    assert child_seed(SEED_MAX - 1, 2) == 0  # wrapped modulo 2**64, as torch reads a seed
    prompt_len = len(outputs[0].prompt_token_ids)
    assert [o.stats.cached_tokens for o in outputs[1:]] == [prompt_len, prompt_len]  # copied from sample 0
    greedy = llm.generate_n(prompt, SamplingParams(max_tokens=8), 3, method="none")
    assert greedy[0].token_ids == greedy[1].token_ids == greedy[2].token_ids


def test_generate_n_best_of_ranks_by_cumulative_logprob(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    prompt = "generate_n best_of:"
    candidates = llm.generate_n(prompt, dataclasses.replace(params, logprobs=0), 4)
    scores = [math.fsum(lp.logprob for lp in c.logprobs) for c in candidates]
    (best,) = llm.generate_n(prompt, params, 1, best_of=4)
    assert best.token_ids == candidates[max(range(4), key=lambda i: scores[i])].token_ids
    assert best.logprobs is None
    with pytest.raises(ValueError, match="best_of"):
        llm.generate_n(prompt, params, 3, best_of=2)


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_generate_n_of_every_method_equals_plain_decodings(llm, method):
    """Including methods whose drafters read the prompt's hidden states: their samples start on
    the first sample's prefill and its captured states too."""
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=77, ignore_eos=True)
    prompt = "every method: def h(z):"
    plain = llm.generate_n(prompt, params, 3, method="none")
    outputs = llm.generate_n(prompt, params, 3, method=method)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    prompt_len = len(outputs[0].prompt_token_ids)
    assert [o.stats.cached_tokens for o in outputs[1:]] == [prompt_len, prompt_len]


def test_a_request_whose_head_reads_hidden_states_starts_only_on_a_prefill_that_captures_them(llm):
    ids = llm.tokenizer.encode("shared states: def g(y):")
    params = SamplingParams(max_tokens=4)
    gens = {name: llm.engine.begin(ids, params, None if name == "none" else llm.new_drafter(name), fresh=True)
            for name in ("none", "eagle", "medusa")}
    try:
        assert gens["none"].can_start_on(gens["eagle"])  # plain decoding needs no states
        assert not gens["eagle"].can_start_on(gens["none"])  # that prefill captures none
        assert not gens["eagle"].can_start_on(gens["medusa"])  # other layers
        other = llm.engine.begin(ids + [5], params, llm.new_drafter("eagle"), fresh=True)
        assert not gens["eagle"].can_start_on(other)  # another prompt
        llm.engine.caches.discard(other.cache)
    finally:
        for gen in gens.values():
            llm.engine.caches.discard(gen.cache)
