"""The public API's shapes: events with the final output, token-id prompts, per-call overrides."""

from __future__ import annotations

import pytest

from specdecode import LLM, SamplingParams
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
