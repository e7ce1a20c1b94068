"""Predicted outputs: the client's expected text is a free draft source; the output never moves."""

from __future__ import annotations

import dataclasses

import pytest

from specdecode import LLM, SamplingParams
from specdecode.drafters.prediction import Prediction
from specdecode.errors import InvalidSamplingParamsError
from specdecode.sequence import SequenceState
from tests.methods import SPEC_METHODS, RandomK

PROMPT = "def f(x) return x + 1 class A : self def f(x)"
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_pair, tiny_pair_heads):
    target, draft = tiny_pair
    return LLM(model=str(target), draft=str(draft), max_seq_len=512, progress=False, **tiny_pair_heads)


def _edited(ids: list[int]) -> list[int]:
    """The plain answer with an edit in its middle (a few tokens replaced, some dropped), as a
    client's prediction of an edited file usually is. (Token ids: a random tiny model's bytes are
    seldom UTF-8, so its answers do not survive a trip through text.)"""
    mid = len(ids) // 2
    return ids[:mid] + [7, 8, 9] + ids[mid + 6 :]


@pytest.mark.parametrize("method", ("none", *SPEC_METHODS))
def test_greedy_output_is_the_targets_whatever_the_prediction(llm, method):
    plain = llm.generate(PROMPT, GREEDY, method="none")[0]
    exact = plain.token_ids
    for prediction in (exact, _edited(plain.token_ids), "zzz qqq nothing alike", ""):
        params = dataclasses.replace(GREEDY, prediction=prediction)
        out = llm.generate(PROMPT, params, method=method)[0]
        assert out.token_ids == plain.token_ids, (method, prediction[:8])
        stats = out.stats
        if prediction == exact:  # fewer target steps than tokens (a free copy may beat it to a step)
            assert stats.target_steps < len(plain.token_ids) - 1
            assert stats.prediction_accepted > stats.prediction_rejected or method != "none"
        if not prediction:
            assert stats.prediction_accepted == stats.prediction_rejected == 0


@pytest.mark.parametrize("method", ("none", "draft_model", "combined"))
def test_seeded_sampling_and_random_k_keep_the_output(llm, method, monkeypatch):
    monkeypatch.setattr(llm.engine, "policy", RandomK(seed=3))
    sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=5)
    plain = llm.generate(PROMPT, sampled, method="none")[0]
    params = dataclasses.replace(sampled, prediction=plain.token_ids)
    out = llm.generate(PROMPT, params, method=method)[0]
    assert out.token_ids == plain.token_ids
    assert out.stats.prediction_accepted > 0


def _seq(prompt: list[int], output: list[int]) -> SequenceState:
    return SequenceState(prompt + output, len(prompt), GREEDY)


def test_the_prediction_realigns_after_the_output_departs_from_it():
    predicted = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    p = Prediction(predicted)
    first = p.source(_seq([1, 2], []))
    assert first.limit == len(predicted)  # from the start
    assert _draft(p, [1, 2], [10, 11, 12]) == [13, 14, 15]  # followed: continues
    # the output renamed 13 to 99, then went on as predicted: after three matching tokens again
    assert _draft(p, [1, 2], [10, 11, 12, 99]) is None
    assert _draft(p, [1, 2], [10, 11, 12, 99, 14, 15, 16]) == [17, 18, 19]
    # an inserted run, then the prediction resumes
    assert _draft(p, [1, 2], [10, 11, 12, 99, 14, 15, 16, 17, 50, 51, 18, 19, 20]) == [21]
    assert _draft(p, [1, 2], predicted) is None  # used up


def test_a_repeated_line_realigns_at_the_occurrence_ahead():
    line = [7, 8, 9]
    p = Prediction([1, *line, 2, 3, *line, 4, 5])
    assert _draft(p, [0], [1, *line, 2]) == [3, 7, 8]
    assert _draft(p, [0], [1, *line, 2, 3, 6, *line]) == [4, 5]  # the second 7 8 9, not the first


def _draft(p: Prediction, prompt: list[int], output: list[int]) -> list[int] | None:
    source = p.source(_seq(prompt, output))
    if source is None:
        return None
    gen = source.draft(_seq(prompt, output), 3)
    try:
        next(gen)
    except StopIteration as done:
        return done.value.tokens.tolist()
    raise AssertionError("a copy needs no model call")


def test_a_prediction_must_be_text():
    with pytest.raises(InvalidSamplingParamsError, match="prediction must be text or a list of token ids"):
        SamplingParams(prediction={"type": "content"})
    assert SamplingParams(prediction=[1, 2]).prediction == (1, 2)
