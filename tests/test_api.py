"""The public API's shapes: events with the final output, token-id prompts, per-call overrides,
lists of prompts decoded as one batch."""

from __future__ import annotations

import math

import pytest

from specdecode import LLM, SamplingParams
from specdecode.engine.batch import Batch
from specdecode.models.decoder import Decoder
from specdecode.errors import InvalidConfigError

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_pair) -> LLM:
    return LLM(model=str(tiny_pair[0]), draft=str(tiny_pair[1]), method="draft_model", num_speculative_tokens=3,
               max_seq_len=256, progress=False)


def test_events_carry_the_pieces_then_the_whole_output(llm) -> None:
    events = list(llm.events("hello", PARAMS))
    assert all(e.output is None for e in events[:-1]) and events[-1].output is not None
    out = events[-1].output
    assert "".join(e.text for e in events) == out.text
    assert [t for e in events for t in e.token_ids] == out.token_ids and out.stats.completion_tokens == 8


def test_the_first_token_arrives_before_any_decode_or_draft_forward(llm, monkeypatch) -> None:
    """A stream's first token is the prefill's: it is delivered when the prefill ends, not after
    the next step's draft-model catch-up on the whole prompt, its drafts and their verification."""
    calls: list[str] = []
    depth = [0]
    for name in ("forward", "forward_batch"):  # either may call the other: count the outer call
        real = getattr(Decoder, name)

        def counted(self, *args, _real=real, **kwargs):
            if not depth[0]:
                calls.append("target" if self is llm.target else "draft")
            depth[0] += 1
            try:
                return _real(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(Decoder, name, counted)
    events = llm.events("hello " * 20, PARAMS)
    first = next(events)
    assert first.token_ids and calls == ["target"]  # the prefill alone
    rest = list(events)
    assert "draft" in calls and rest[-1].output.token_ids[:1] == first.token_ids


def test_token_ids_and_text_give_the_same_output(llm) -> None:
    ids = llm.tokenizer.encode("hello")
    [by_text] = llm.generate("hello", PARAMS)
    [by_ids] = llm.generate(ids, PARAMS)
    assert by_ids.token_ids == by_text.token_ids and by_ids.prompt_token_ids == ids
    two = llm.generate([ids, ids[:-1]], PARAMS)
    assert len(two) == 2 and two[0].token_ids == by_text.token_ids
    assert "".join(llm.stream(ids, PARAMS)) == by_text.text


def test_per_call_overrides_are_validated_and_used(llm) -> None:
    [plain] = llm.generate("hello", PARAMS, method="none")
    [fixed] = llm.generate("hello", PARAMS, num_speculative_tokens=2, adaptive=False)
    assert plain.method == "none" and fixed.method == "draft_model" and fixed.token_ids == plain.token_ids
    with pytest.raises(InvalidConfigError, match="num_speculative_tokens"):
        llm.generate("hello", PARAMS, num_speculative_tokens=99)
    with pytest.raises(InvalidConfigError, match="unknown method"):
        llm.events("hello", PARAMS, method="bogus")
    assert llm.spec.num_speculative_tokens == 3 and llm.spec.adaptive  # the defaults are untouched


def test_unknown_settings_are_named(tiny_pair) -> None:
    with pytest.raises(InvalidConfigError, match="num_speculative_token\\b.*the speculative ones are"):
        LLM(model=str(tiny_pair[0]), num_speculative_token=4, progress=False)


def _steps_running(monkeypatch) -> list[int]:
    """How many requests each step of the step loop runs, from now on."""
    running: list[int] = []
    step = Batch.step

    def counting(self: Batch):
        running.append(len(self))
        return step(self)

    monkeypatch.setattr(Batch, "step", counting)
    return running


def test_a_list_of_prompts_decodes_as_one_batch_with_each_prompts_own_output(llm, monkeypatch) -> None:
    prompts = [f"batch {i}: def f{i}(x):" for i in range(5)]
    solo = [llm.generate(p, PARAMS)[0].token_ids for p in prompts]
    running = _steps_running(monkeypatch)
    outputs = llm.generate(prompts, PARAMS, max_batch=2)
    assert [o.token_ids for o in outputs] == solo  # in the prompts' order
    assert max(running) == 2 and len(running) < sum(len(ids) for ids in solo)
    with pytest.raises(InvalidConfigError, match="max_batch"):
        llm.generate(prompts, PARAMS, max_batch=0)


def test_a_batch_waits_for_room_in_the_memory_budget(tiny_pair, monkeypatch) -> None:
    """With room for one request's cache, the others wait for it to end instead of failing."""
    roomy = LLM(model=str(tiny_pair[0]), max_seq_len=256, progress=False, prefix_cache=False)
    caches = roomy.engine.caches
    prompts = [f"room {i}:" for i in range(3)]
    tokens = max(len(roomy.tokenizer.encode(p)) for p in prompts) + PARAMS.max_tokens
    one = math.ceil(tokens / caches.block) * caches.block * caches.slot_bytes
    tight = LLM(model=str(tiny_pair[0]), max_seq_len=256, progress=False, prefix_cache=False,
                kv_cache_memory=one + one // 2)
    running = _steps_running(monkeypatch)
    outputs = tight.generate(prompts, PARAMS, max_batch=3)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in roomy.generate(prompts, PARAMS, max_batch=1)]
    assert max(running) == 1
