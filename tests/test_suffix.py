"""The suffix drafter: its sources and priorities, the shared history, and exact greedy output."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from specdecode import LLM, SamplingParams
from specdecode.sequence import SequenceState
from specdecode.drafters.suffix import SuffixDrafter, SuffixHistory
from specdecode.errors import DatastoreError, InvalidConfigError
from specdecode.index import Datastore, build_datastore, tokenizer_fingerprint
from tests.conftest import spec_k

SEEDS = range(4)


def _seq(tokens: list[int]) -> SequenceState:
    return SequenceState(list(tokens), len(tokens), SamplingParams())


def _propose(drafter: SuffixDrafter, tokens: list[int], k: int = 8) -> list[int]:
    seq = _seq(tokens)
    drafter.begin(seq)
    return drafter.propose(seq, k).tokens.tolist()


def _store(tmp_path, docs: list[list[int]]) -> Datastore:
    out = tmp_path / "store"
    build_datastore([np.array(d, dtype=np.int32) for d in docs], out, vocab_size=300, tokenizer_fingerprint="fp")
    return Datastore.open(out)


def test_own_context_drafts_the_most_frequent_continuation():
    drafter = SuffixDrafter()
    assert _propose(drafter, [1, 2, 3, 4, 1, 2], k=3) == [3, 4, 1]
    # "1 2" went on with 4 twice and 3 once: the majority wins; then "1 2 4" went on with 7 and
    # with 8 once each, and the tie goes to the most recent occurrence.
    assert _propose(drafter, [5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2, 4, 8, 1, 2], k=2) == [4, 8]
    assert _propose(drafter, [1, 2, 3, 4]) == []  # nothing repeats
    proposal = drafter.propose(_seq([1, 2, 1, 2]), 4)
    assert proposal.probs is None  # deterministic: exact for greedy and sampling


def test_own_context_grows_with_the_request():
    drafter = SuffixDrafter()
    seq = _seq([7, 8, 9, 1])
    drafter.begin(seq)
    assert drafter.propose(seq, 4).k == 0
    seq.token_ids += [7, 8]  # committed by the engine
    drafter.accept(seq, 0)
    assert drafter.propose(seq, 4).tokens.tolist() == [9, 1, 7, 8]


def test_longest_match_wins_across_sources(tmp_path):
    store = _store(tmp_path, [[10, 11, 12, 13, 50, 51], [12, 13, 60]])
    history = SuffixHistory()
    history.add([11, 12, 13, 40, 41])
    # own: "12 13" -> 20; history: "11 12 13" -> 40; store: "10 11 12 13" -> 50 (longest).
    assert _propose(SuffixDrafter(store, history), [12, 13, 20, 21, 10, 11, 12, 13], k=2) == [50, 51]
    # Without the 4-token match the history's 3-token match beats the own 2-token one and ties
    # with the store's, and history comes before the store.
    assert _propose(SuffixDrafter(store, history), [12, 13, 20, 21, 9, 11, 12, 13], k=2) == [40, 41]


def test_ties_go_to_own_context_then_history(tmp_path):
    store = _store(tmp_path, [[1, 2, 30, 31]])
    history = SuffixHistory()
    history.add([1, 2, 20, 21])
    drafter = SuffixDrafter(datastore=store, history=history)
    assert _propose(drafter, [1, 2, 10, 11, 1, 2], k=2) == [10, 11]
    drafter = SuffixDrafter(datastore=store, history=history)
    assert _propose(drafter, [5, 1, 2], k=2) == [20, 21]
    drafter = SuffixDrafter(datastore=store)
    assert _propose(drafter, [5, 1, 2], k=2) == [30, 31]


def test_a_source_with_nothing_after_its_match_yields_to_the_next(tmp_path):
    history = SuffixHistory()
    history.add([3, 4, 5])  # "4 5" ends the request: no continuation
    store = _store(tmp_path, [[4, 5, 6, 7]])
    assert _propose(SuffixDrafter(datastore=store, history=history), [9, 4, 5], k=2) == [6, 7]


def test_min_match_and_max_match():
    assert _propose(SuffixDrafter(min_match=3), [1, 2, 3, 9, 1, 2]) == []  # only a 2-token match
    assert _propose(SuffixDrafter(min_match=3), [1, 2, 3, 9, 1, 2, 3], k=1) == [9]
    with pytest.raises(InvalidConfigError):
        SuffixDrafter(min_match=0)
    with pytest.raises(InvalidConfigError):
        SuffixDrafter(min_match=5, max_match=4)


def test_finished_requests_join_the_history_once():
    history = SuffixHistory()
    drafter = SuffixDrafter(history=history)
    first = _seq([1, 2, 3, 4, 5])
    drafter.begin(first)
    first.token_ids += [6, 7]
    drafter.finish(first)
    drafter.finish(first)
    assert len(history) == 8  # 7 tokens + one separator, added once
    second = _seq([9, 9, 4, 5])
    drafter.begin(second)  # nothing new to add
    assert len(history) == 8
    assert drafter.propose(second, 3).tokens.tolist() == [6, 7]  # the output of the first request
    drafter.begin(_seq([0]))  # without finish(), begin adds the previous request
    assert len(history) == 8 + 5


def test_history_is_bounded_and_keeps_the_newest():
    history = SuffixHistory(max_tokens=100)
    for i in range(50):
        history.add([1000 + i] * 9)
        assert len(history) <= 100
    match = history.match([1049, 1049], 2, 32)
    assert match is not None and match.continuation(3) == [1049, 1049, 1049]
    assert history.match([1000, 1000], 2, 32) is None  # dropped long ago


def test_history_never_matches_across_requests():
    history = SuffixHistory()
    history.add([1, 2])
    history.add([3, 4])
    assert history.match([2, 3], 2, 32) is None


def test_history_is_thread_safe():
    history = SuffixHistory(max_tokens=1 << 16)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(40):
                history.add([w, i, w, i + 1])
                history.match([w, i], 2, 8)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(history) == 8 * 40 * 5
    for w in range(8):
        assert history.match([7, w, 39], 2, 8).continuation(2) == [w, 40]


def test_datastore_for_another_tokenizer_is_refused(tmp_path, tiny_pair):
    from specdecode.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_pair[0])
    store = _store(tmp_path, [[1, 2, 3]])  # fingerprint "fp": not this tokenizer's
    with pytest.raises(DatastoreError):
        SuffixDrafter(datastore=store, tokenizer=tok)


# --- exactness on a tiny model ------------------------------------------------------------------


def _prompt(seed: int) -> str:
    rng = random.Random(seed)
    words = ["def", "f(x)", "return", "x", "+", "1", "\n", "class", "A", ":", "self"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))


def _greedy(n: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_pair):
    return LLM(model=str(tiny_pair[0]), max_seq_len=512, progress=False)


@pytest.fixture(scope="module")
def plain(llm) -> dict[int, list[int]]:
    return {s: llm.engine.generate(llm.tokenizer.encode(_prompt(s)), _greedy()).token_ids for s in SEEDS}


@pytest.fixture(scope="module")
def output_store(llm, plain, tmp_path_factory) -> Datastore:
    """A store of the plain outputs (not the prompts): drafts come from it once output starts."""
    out = tmp_path_factory.mktemp("suffix") / "store"
    build_datastore([np.array(ids, dtype=np.int32) for ids in plain.values()], out,
                    vocab_size=llm.tokenizer.vocab_size, tokenizer_fingerprint=tokenizer_fingerprint(llm.tokenizer))
    return Datastore.open(out, tokenizer=llm.tokenizer)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_identity_with_and_without_datastore(llm, plain, output_store, k):
    accepted = {}
    for name, store in (("none", None), ("store", output_store)):
        accepted[name] = 0
        for seed in SEEDS:
            drafter = SuffixDrafter(datastore=store, tokenizer=llm.tokenizer)
            out = llm.engine.generate(llm.tokenizer.encode(_prompt(seed)), _greedy(), drafter, spec_k(k, adaptive=False))
            assert out.token_ids == plain[seed], (name, k, seed)
            assert out.method == "suffix"
            accepted[name] += out.stats.accepted_tokens
    assert accepted["store"] > 0
    assert accepted["store"] > accepted["none"]  # the store's copy of the output helps


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_identity_with_history_of_earlier_requests(llm, plain, k):
    history = SuffixHistory()
    drafter = SuffixDrafter(history=history)  # one drafter reused across requests, like LLM.drafter()
    first = {}
    for seed in SEEDS:
        out = llm.engine.generate(llm.tokenizer.encode(_prompt(seed)), _greedy(), drafter, spec_k(k, adaptive=False))
        assert out.token_ids == plain[seed]
        first[seed] = out.stats
    drafter.finish()
    assert len(history) > 0
    for seed in SEEDS:  # the same requests again: the history holds their whole output
        fresh = SuffixDrafter(history=history)
        out = llm.engine.generate(llm.tokenizer.encode(_prompt(seed)), _greedy(), fresh, spec_k(k, adaptive=False))
        assert out.token_ids == plain[seed], (k, seed)
        assert out.stats.accepted_tokens > first[seed].accepted_tokens
        assert out.stats.target_steps < first[seed].target_steps
        fresh.finish()


def test_sampled_copies_of_the_sampled_answer_are_all_kept(llm, tmp_path):
    """Copies are verified under sampling by each row's race: a store holding plain sampled
    decoding's answer (same seed) drafts it, every copy is kept, and the output is that answer."""
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=1, ignore_eos=True)
    prompt = llm.tokenizer.encode(_prompt(0))
    plain = llm.engine.generate(prompt, params)
    build_datastore([np.array(plain.token_ids, dtype=np.int32)], tmp_path / "store", vocab_size=llm.tokenizer.vocab_size,
                    tokenizer_fingerprint=tokenizer_fingerprint(llm.tokenizer))
    store = Datastore.open(tmp_path / "store", tokenizer=llm.tokenizer)
    out = llm.engine.generate(prompt, params, SuffixDrafter(datastore=store), spec_k(4, adaptive=False))
    assert out.token_ids == plain.token_ids
    assert out.stats.draft_tokens > 0 and out.stats.accepted_tokens == out.stats.draft_tokens


def test_engine_feeds_finished_requests_to_the_shared_history(llm, plain):
    """A fresh drafter per request (the server's way): the engine's finish hook fills the LLM's history."""
    prompt = llm.tokenizer.encode(_prompt(1))
    before = len(llm.suffix_history)
    first = llm.engine.generate(prompt, _greedy(), llm.new_drafter("suffix"), spec_k(8, adaptive=False))
    assert len(llm.suffix_history) > before
    again = llm.engine.generate(prompt, _greedy(), llm.new_drafter("suffix"), spec_k(8, adaptive=False))
    assert first.token_ids == again.token_ids == plain[1]
    assert again.stats.target_steps < first.stats.target_steps


def test_history_clear_forgets_earlier_requests():
    history = SuffixHistory()
    history.add([1, 2, 3, 4, 5])
    assert history.match([1, 2, 3], 2, 8) is not None
    history.clear()
    assert len(history) == 0 and history.match([1, 2, 3], 2, 8) is None
