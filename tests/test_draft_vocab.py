"""A draft model whose LM head computes only part of the vocabulary (``Decoder.restrict_vocabulary``).

The restricted logits are the full logits' columns at the kept ids, in every weight form a draft
can hold; drafting from the subset keeps greedy output identical to plain decoding (also when the
target's token is outside the subset, so the draft can never propose it) and sampled output in
the target's law; the shipped ranking is refused for another tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.drafters.draft_vocab import (RANKING_PATH, VocabRanking, draft_vocab_ids, load_ranking, rank_tokens,
                                             save_ranking)
from specdecode.drafters.base import Drafter
from specdecode.drafters.registry import build_drafter
from specdecode.errors import InvalidConfigError, VocabularyRankingError
from specdecode.models import draft_quant
from specdecode.models.decoder import Decoder
from specdecode.models.gguf_planes import GGUFLinear
from specdecode.models.int8_rows import Int8Rows
from tests.conftest import TINY_VOCAB, spec_k
from tests.gguf_blocks import write_model_gguf
from tests.test_gguf_planes import MIXED
from tests.test_sampling_lossless import _prompt_with_likely_continuations, assert_sampled_joint_is_exact

DRAFT_METHODS = ("draft_model", "combined", "tree")


def _subset(vocab: int, n: int, seed: int = 0, leave_out: tuple[int, ...] = ()) -> torch.Tensor:
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist()
    return torch.tensor(sorted([i for i in order if i not in leave_out][:n]))


def _columns_match(model: Decoder, ids: torch.Tensor, exact: bool, rows: int = 12) -> None:
    """Prefill ``rows`` tokens, then decode 1 and 3 rows; restricted logits == full columns."""
    small = model.restrict_vocabulary(ids)
    assert small.vocab_ids is not None and torch.equal(small.vocab_ids, ids) and model.vocab_ids is None
    tokens = torch.randint(0, min(model.config.vocab_size, 256), (rows + 4,), generator=torch.Generator().manual_seed(2))
    full_cache, small_cache = model.new_cache(64), small.new_cache(64)
    for chunk in (tokens[:rows], tokens[rows : rows + 1], tokens[rows + 1 :]):
        full, part = model.forward(chunk, full_cache), small.forward(chunk, small_cache)
        assert part.shape == (chunk.numel(), ids.numel())
        if exact:
            assert torch.equal(part, full[:, ids]), chunk.numel()
        else:
            torch.testing.assert_close(part, full[:, ids], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_restricted_logits_are_the_full_columns(tiny_models, quantize):
    model = Decoder.from_dir(tiny_models["qwen2"], role="draft", quantize=quantize)
    ids = _subset(96, 40)
    # int4: the fused forward (few rows) and the per-row int8 copy (prefill) compute rows alone.
    _columns_match(model, ids, exact=quantize == "int4")
    if quantize == "int4":
        assert model.backend.fused is not None and model.restrict_vocabulary(ids).backend.fused is not None
        assert isinstance(model.restrict_vocabulary(ids).lm_head.int8, Int8Rows)
        _columns_match(model.with_backend(model.backend.layered()), ids, exact=True)


def test_restricted_logits_of_an_int8_rows_head(tiny_models):
    model = Decoder.from_dir(tiny_models["llama"], role="target", quantize="int8")
    assert isinstance(model.lm_head, Int8Rows)
    _columns_match(model, _subset(96, 33), exact=True)


@pytest.mark.parametrize("tied", [False, True])
def test_restricted_logits_of_gguf_heads(tmp_path: Path, tied: bool):
    """A GGUF head run natively (Q6_K output, or the Q8_0 embedding when tied), and the int4 draft
    packed from that GGUF, whose prefill runs on the GGUF rows."""
    write_model_gguf(tmp_path / "m.gguf", MIXED, seed=3, tied=tied)
    llm = LLM(model=str(tmp_path / "m.gguf"), draft=str(tmp_path / "m.gguf"), max_seq_len=64, progress=False,
              draft_vocab=0)
    vocab = llm.target.config.vocab_size
    ids = _subset(vocab, vocab // 3)
    assert isinstance(llm.target.lm_head, GGUFLinear)
    _columns_match(llm.target, ids, exact=True)
    draft = llm.draft_model
    assert isinstance(draft.lm_head, draft_quant.Int4Groups) and isinstance(draft.lm_head.int8, GGUFLinear)
    _columns_match(draft, ids, exact=True)


def test_bad_ids_are_named_errors(tiny_models):
    model = Decoder.from_dir(tiny_models["qwen2"], role="draft")
    for bad in ([], [0, 96], [-1], [3, 3]):
        with pytest.raises(InvalidConfigError):
            model.restrict_vocabulary(torch.tensor(bad, dtype=torch.long))
    with pytest.raises(InvalidConfigError, match="already restricted"):
        model.restrict_vocabulary(torch.arange(10)).restrict_vocabulary(torch.arange(5))


@pytest.fixture(scope="module")
def pair_llm(tiny_pair):
    target, draft = tiny_pair
    return LLM(model=str(target), draft=str(draft), max_seq_len=300, progress=False)


def _restricted(llm: LLM, method: str, ids: torch.Tensor) -> Callable[[], Drafter]:
    """New drafters of ``method`` whose draft model's head covers only ``ids`` (one restricted model)."""
    resources = dataclasses.replace(llm.resources, draft_model=llm.draft_model.restrict_vocabulary(ids))
    return lambda: build_drafter(method, resources, llm.engine.max_seq_len)


def test_the_tiny_pair_keeps_the_whole_head_by_default(pair_llm):
    """The shipped ranking is for Qwen2.5's tokenizer, not the tiny byte tokenizer."""
    assert pair_llm.draft_model.vocab_ids is None


@pytest.mark.parametrize("method", DRAFT_METHODS)
def test_greedy_identity_with_a_restricted_draft(pair_llm, method):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    drafted = accepted = 0
    for seed, prompt in enumerate(("def f(x): return x + 1\ndef f(x):", "class A:\n    def a(self):", "hello hello")):
        ids = pair_llm.tokenizer.encode(prompt)
        plain = pair_llm.engine.generate(ids, params, None, spec_k(4)).token_ids
        # The first token the target writes (and others) are out of the draft's reach.
        subset = _subset(TINY_VOCAB, TINY_VOCAB // 2, seed, leave_out=tuple(plain[:1]) + tuple(plain[5:8]))
        assert plain[0] not in subset.tolist()
        for adaptive in (False, True):
            out = pair_llm.engine.generate(ids, params, _restricted(pair_llm, method, subset)(), spec_k(4, adaptive))
            assert out.token_ids == plain, (method, seed, adaptive)
            drafted += out.stats.draft_tokens
            accepted += out.stats.accepted_tokens
    assert drafted > 0 and 0 < accepted < drafted


@pytest.mark.parametrize("method", ["draft_model", "tree"])
def test_sampling_law_with_a_restricted_draft(pair_llm, method):
    """The joint law of three sampled tokens (top_k = 3) stays the target's when the draft's
    distribution is renormalised over a subset that misses some of the target's likely tokens."""
    llm = pair_llm
    ids = _prompt_with_likely_continuations(llm, SamplingParams(max_tokens=3, temperature=1.0, top_k=3))
    first = llm.target.forward(torch.tensor(ids), llm.target.new_cache(len(ids) + 1), last_only=True)[0]
    likely = tuple(first.topk(3).indices.tolist())
    subset = _subset(TINY_VOCAB, 3 * TINY_VOCAB // 4, leave_out=likely[1:2])  # one of the 3 outcomes is out of reach
    assert_sampled_joint_is_exact(llm, ids, _restricted(llm, method, subset))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, seed=0), SamplingParams(temperature=1.0, top_k=5, seed=0),
                                    SamplingParams(temperature=0.9, top_p=0.8, seed=0)])
def test_a_subset_draft_wins_the_race_over_its_distribution_spread_on_the_vocabulary(params):
    """A sampled draft from a restricted head races over the subset's columns only; the winner,
    and its probability, are those of the race over the whole vocabulary with zeros outside the
    subset (the distribution the exact rule is stated over), for ids in any order."""
    from specdecode.drafters.base import pick_from_subvocabulary
    from specdecode.sample.race import RaceKeys, race
    from specdecode.sample.sampling import logits_to_probs
    from specdecode.sequence import SequenceState

    vocab = 4000
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:1500]  # ranking order, not id order
    seq = SequenceState([1, 2, 3], 3, params, torch.Generator().manual_seed(0), None, RaceKeys(7))
    winners = set()
    for position in range(200):
        logits = torch.randn(ids.numel(), generator=torch.Generator().manual_seed(position)) * 3
        token, dist, p_token = pick_from_subvocabulary(logits, ids, vocab, seq, True, argmax=False,
                                                       position=position, params=params)
        full = torch.full((vocab,), -torch.inf)
        full[ids] = logits
        probs = logits_to_probs(full[None], params)[0]
        assert dist is None and token == int(race(probs, seq.keys.at(position, vocab)))
        assert p_token == pytest.approx(float(probs[token]), rel=1e-5)
        winners.add(token)
    assert len(winners) > 20 and winners <= set(ids.tolist())


def test_structured_output_masks_the_subset(pair_llm):
    """A grammar's mask is read at the subset's ids; a subset without an allowed token drafts nothing."""
    from specdecode.params import Constraint

    params = SamplingParams(max_tokens=20, temperature=0.0, constraint=Constraint("regex", "[0-9]{3}-[a-z]{4}"))
    ids = pair_llm.tokenizer.encode("code: ")
    plain = pair_llm.engine.generate(ids, params, None, spec_k(4)).token_ids
    digits = [pair_llm.tokenizer.encode(str(d))[0] for d in range(10)]
    for subset in (_subset(TINY_VOCAB, 200, leave_out=tuple(digits[:5])), torch.tensor(digits)):
        out = pair_llm.engine.generate(ids, params, _restricted(pair_llm, "draft_model", subset)(), spec_k(4, False))
        assert out.token_ids == plain


def test_ranking_order_and_top(tmp_path: Path):
    counts = Counter({5: 3, 7: 9, 2: 3, 300: 1})
    ranked = rank_tokens(counts, special_ids=[9, 1], vocab_size=20)
    assert ranked == (1, 9, 7, 2, 5)  # specials, then by count (ties by id); 300 is outside
    ranking = VocabRanking(20, "fp", ranked)
    assert ranking.top(3).tolist() == [1, 7, 9]
    assert ranking.top(7).tolist() == [0, 1, 2, 3, 5, 7, 9]  # then unseen ids in increasing order
    path = tmp_path / "r.json"
    save_ranking(ranking, path)
    assert load_ranking(path) == ranking


def test_a_ranking_for_another_tokenizer_is_refused(pair_llm, tmp_path: Path):
    path = tmp_path / "r.json"
    save_ranking(VocabRanking(TINY_VOCAB, "another tokenizer", (256, 1, 2, 3)), path)
    tok = pair_llm.tokenizer
    with pytest.raises(VocabularyRankingError, match="another tokenizer"):
        draft_vocab_ids(100, 50, tok, TINY_VOCAB, path)
    assert draft_vocab_ids(None, 50, tok, TINY_VOCAB, path) is None  # the default falls back to the whole head
    assert draft_vocab_ids(0, 50, tok, TINY_VOCAB, path) is None
    from specdecode.index.fingerprint import tokenizer_fingerprint

    save_ranking(VocabRanking(TINY_VOCAB, tokenizer_fingerprint(tok), (256, 1, 2, 3)), path)
    assert draft_vocab_ids(None, 3, tok, TINY_VOCAB, path).tolist() == [1, 2, 256]
    path.write_text("{not json")
    with pytest.raises(VocabularyRankingError, match="cannot read"):
        draft_vocab_ids(100, 50, tok, TINY_VOCAB, path)


def test_llm_refuses_an_explicit_size_for_another_tokenizer(tiny_pair):
    target, draft = tiny_pair
    with pytest.raises(VocabularyRankingError):
        LLM(model=str(target), draft=str(draft), max_seq_len=64, progress=False, draft_vocab=100)
    with pytest.raises(InvalidConfigError):
        LLM(model=str(target), max_seq_len=64, progress=False, draft_vocab=-1)


def test_the_shipped_ranking_is_for_qwen2_5():
    ranking = load_ranking()
    data = json.loads(RANKING_PATH.read_text())
    assert ranking.vocab_size == 151936 and len(ranking.ranked) > 1000 and RANKING_PATH.stat().st_size < 300_000
    assert {151643, 151645} <= set(ranking.ranked[:30]) and "calibration prompts" in data["source"]


def test_draft_vocab_flag():
    import argparse

    from specdecode.cli.options import draft_vocab_arg

    assert draft_vocab_arg("full") == 0 and draft_vocab_arg("auto") is None and draft_vocab_arg("4096") == 4096
    for bad in ("-3", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            draft_vocab_arg(bad)
