"""Logprobs come from the target's rows: bit for bit plain decoding's, through every drafter, and
in OpenAI's shapes over HTTP (tiny models)."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from server_support import LiveServer, sse_events
from specdecode import LLM, Constraint, SamplingParams
from specdecode.errors import InvalidSamplingParamsError
from specdecode.sample.logprobs import LOGPROB_FLOOR
from specdecode.server.app import create_app
from specdecode.server.scheduler import Scheduler
from tests.methods import SPEC_METHODS

PROMPTS = ["def f(x):\n    return x + x", "a b a b a b a", "hello"]


@pytest.fixture(scope="module")
def llm(tiny_pair, tiny_pair_heads):
    target, draft = tiny_pair
    return LLM(model=str(target), draft=str(draft), max_seq_len=512, progress=False, **tiny_pair_heads)


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_logprobs_equal_plain_decodings_bitwise(llm, method):
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=5, ignore_eos=True)
    accepted = 0
    for prompt in PROMPTS:
        plain = llm.generate(prompt, params, method="none")[0]
        spec = llm.generate(prompt, params, method=method, num_speculative_tokens=4, adaptive=False)[0]
        assert spec.token_ids == plain.token_ids
        assert spec.logprobs == plain.logprobs  # floats compared exactly
        accepted += spec.stats.accepted_tokens
    assert accepted > 0  # tokens came from verify rows past the first


def test_logprobs_are_the_targets_distribution(llm):
    """Each value is log_softmax of the target's logits for the whole sequence so far (a separate
    full forward, so a rounding-level difference is allowed); the top list is sorted and holds
    the greedy token first."""
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
    out = llm.generate(PROMPTS[0], params, method="draft_model")[0]
    ids = out.prompt_token_ids + out.token_ids
    logits = llm.target.forward(torch.tensor(ids), llm.target.new_cache(len(ids)))
    want = torch.log_softmax(logits.float(), -1)
    assert len(out.logprobs) == len(out.token_ids)
    for i, lp in enumerate(out.logprobs):
        row = want[len(out.prompt_token_ids) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the chosen token leads
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.top[2][1] == pytest.approx(float(row.topk(3).values[2]), abs=1e-4)


def test_sampled_logprobs_ignore_temperature_and_count_the_mask(llm):
    """Raw logprobs (before temperature); under a grammar, forbidden tokens are at the floor."""
    hot = SamplingParams(max_tokens=8, temperature=1.7, seed=3, logprobs=0, ignore_eos=True)
    out = llm.generate(PROMPTS[1], hot, method="ngram")[0]
    ids = out.prompt_token_ids + out.token_ids
    logits = llm.target.forward(torch.tensor(ids), llm.target.new_cache(len(ids)))
    for i, lp in enumerate(out.logprobs):
        raw = torch.log_softmax(logits[len(out.prompt_token_ids) - 1 + i].float(), -1)
        assert lp.logprob == pytest.approx(float(raw[lp.token_id]), abs=1e-4) and lp.top == ()
    masked = SamplingParams(max_tokens=8, temperature=0.0, logprobs=20, constraint=Constraint.choice(["ab", "ba"]))
    out = llm.generate("x", masked, method="draft_model")[0]
    assert out.text in ("ab", "ba")
    first = out.logprobs[0]
    assert len(first.top) == 2 and all(v > LOGPROB_FLOOR for _, v in first.top)  # only 'a' and 'b' may start
    assert sum(torch.tensor([v for _, v in first.top]).exp()) == pytest.approx(1.0, abs=1e-5)


def test_bad_logprobs_are_refused():
    for bad in (-1, 21, 2.5):
        with pytest.raises(InvalidSamplingParamsError):
            SamplingParams(logprobs=bad)


@pytest.fixture(scope="module")
def live(tiny_pair):
    target, draft = tiny_pair
    llm = LLM(model=str(target), draft=str(draft), method="draft_model", num_speculative_tokens=4,
              max_seq_len=512, progress=False)
    scheduler = Scheduler(llm, max_concurrency=2)
    with LiveServer(create_app(llm, scheduler, served_model_name="tiny")) as server:
        server.llm = llm
        yield server
    scheduler.close()


def test_chat_logprobs_over_http(live, llm):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "count: 1 2 3"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    want = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0.0, logprobs=2), method="none")
    assert [c.logprob for c in content] == [lp.logprob for lp in want.logprobs]
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", errors="replace") == reply.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [c for chunk in stream for choice in chunk.choices if choice.logprobs
                for c in choice.logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_completion_logprobs_over_http(live, llm):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0, "logprobs": 3}
    status, got = live.post("/v1/completions", body)
    assert status == 200, got
    lp = got["choices"][0]["logprobs"]
    want = llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0, logprobs=3), method="none")[0]
    assert lp["token_logprobs"] == [t.logprob for t in want.logprobs]
    assert "".join(lp["tokens"]) == got["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])
    status, headers, text = live.request("POST", "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(e) for e in sse_events(text) if e != "[DONE]"]
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert sum((p["token_logprobs"] for p in parts), []) == lp["token_logprobs"]
    assert sum((p["text_offset"] for p in parts), []) == lp["text_offset"]


def test_structured_output_over_http(live):
    """response_format json_schema (chat, streamed and not) and structured_outputs (completions)."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "answer in JSON"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                           response_format=fmt)
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content
    status, got = live.post("/v1/completions", {"model": "tiny", "prompt": "pick:", "max_tokens": 10, "temperature": 0.9,
                                                "structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert status == 200 and got["choices"][0]["text"] in ("red", "green", "blue"), got
