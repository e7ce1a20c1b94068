"""A guess (an n-gram copy) handed to the draft model changes what drafting costs, never what it
drafts: the same tokens, the same probabilities, the same cache afterwards."""

from __future__ import annotations

import pytest
import torch

from specdecode.config import SamplingParams
from specdecode.drafters.base import SequenceState
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.models.decoder import Decoder

K = 6
PROMPT = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def draft_model(tiny_pair) -> Decoder:
    return Decoder.from_dir(tiny_pair[1])


def _drafter(model: Decoder, monkeypatch=None, calls: list | None = None) -> DraftModelDrafter:
    drafter = DraftModelDrafter(model, model.config.vocab_size, capacity=128)
    if calls is not None:
        forward = drafter.model.forward

        def counted(*args, **kwargs):
            calls.append(1)
            return forward(*args, **kwargs)

        monkeypatch.setattr(drafter.model, "forward", counted)
    return drafter


def _seq(params: SamplingParams, seed: int = 0) -> SequenceState:
    return SequenceState(list(PROMPT), len(PROMPT), params, torch.Generator().manual_seed(seed))


def _own_chain(model: Decoder, params: SamplingParams) -> list[int]:
    drafter = _drafter(model)
    seq = _seq(params)
    drafter.begin(seq)
    return drafter.draft(seq, K, params.greedy, None).tokens.tolist()


def _guesses(chain: list[int]) -> dict[str, list[int]]:
    wrong = [(t + 1) % 256 for t in chain]
    return {"none": [], "all right": chain, "too long": chain + chain, "right then wrong": chain[:2] + wrong[2:],
            "wrong first": wrong, "one right": chain[:1]}


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)],
                         ids=["greedy", "sampled"])
def test_a_guess_never_changes_the_draft_or_the_cache(draft_model, params):
    chain = _own_chain(draft_model, params)
    reference = _drafter(draft_model)
    ref_seq = _seq(params)
    reference.begin(ref_seq)
    expected = reference.draft(ref_seq, K, params.greedy, None)
    for name, guess in _guesses(chain).items():
        drafter = _drafter(draft_model)
        seq = _seq(params)
        drafter.begin(seq)
        got = drafter.draft(seq, K, params.greedy, None, guess=guess)
        assert got.tokens.tolist() == expected.tokens.tolist(), name
        if params.greedy:
            assert got.probs is None
        else:
            assert torch.equal(got.probs, expected.probs), name
        assert drafter.cache.length == reference.cache.length, name
        # After two drafts are accepted, the next draft must match the unguided drafter's too.
        for d, s in ((drafter, seq), (reference, ref_seq)):
            d.accept(s, 2)
            s.token_ids.extend(expected.tokens[:2].tolist() + [7])
        nxt, ref_next = (d.draft(s, K, params.greedy, None) for d, s in ((drafter, seq), (reference, ref_seq)))
        assert nxt.tokens.tolist() == ref_next.tokens.tolist(), name
        reference = _drafter(draft_model)  # fresh reference for the next guess
        ref_seq = _seq(params)
        reference.begin(ref_seq)
        expected = reference.draft(ref_seq, K, params.greedy, None)


def test_a_right_guess_costs_one_forward(draft_model, monkeypatch):
    params = SamplingParams(temperature=0.0)
    chain = _own_chain(draft_model, params)
    counts = {}
    for name, guess in _guesses(chain).items():
        calls: list[int] = []
        drafter = _drafter(draft_model, monkeypatch, calls)
        seq = _seq(params)
        drafter.begin(seq)
        drafter.draft(seq, K, True, None, guess=guess)
        counts[name] = len(calls)
        monkeypatch.undo()
    # Without a guess: the pending token's forward, then one per draft token but the last.
    assert counts == {"none": K, "all right": 1, "too long": 1, "right then wrong": K - 2,
                      "wrong first": K, "one right": K - 1}, counts
