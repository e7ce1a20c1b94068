"""Batched drafting: concurrent requests share the draft model's forwards, whatever drafter
wraps it, and keep their outputs."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from specdecode.api import LLM
from specdecode.params import SamplingParams
from specdecode.sequence import SequenceState
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine.batch import Batch
from specdecode.engine import trace
from specdecode.engine.drafting import DraftWork, draft_all
from specdecode.engine.costs import MAX_SHARE, ROW_SHARE_PRIOR, StepCosts
from specdecode.engine.policy import CostModel, FixedK
from specdecode.models.decoder import Decoder
from specdecode.sequence import DraftProposal
from specdecode.server.scheduler import Scheduler
from tests.conftest import spec_k

K = 4


@pytest.fixture(scope="module")
def llm(tiny_pair):
    target, draft = tiny_pair
    # Fixed K, no confidence stop: every request drafts exactly K tokens a step, so forwards are countable.
    return LLM(model=str(target), draft=str(draft), method="draft_model", num_speculative_tokens=K,
               adaptive=False, draft_confidence=0.0, max_seq_len=256, progress=False)


def _prompts(llm: LLM) -> list[list[int]]:
    """Prompts of quite different lengths (1 to 50 tokens)."""
    texts = ["x", "def f(a, b):\n", "for i in range(10):\n    print(i * i)\n", "the quick brown fox " * 3]
    return [llm.tokenizer.encode(t) for t in texts]


def _seq(ids: list[int], params: SamplingParams, seed: int = 0) -> SequenceState:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return SequenceState(list(ids), len(ids), params, gen)


def _drafter(llm: LLM, confidence: float) -> DraftModelDrafter:
    return DraftModelDrafter(llm.draft_model, llm.target.config.vocab_size, 256, confidence)


def draft_batch(items) -> list[DraftProposal]:
    """Each (drafter, seq, k)'s proposal, drafted together through the step loop's ``draft_all``."""
    works = [DraftWork(d.drafting(s, k)) for d, s, k in items]
    draft_all(works)
    assert all(w.error is None for w in works)
    return [w.proposal for w in works]


def test_draft_batch_equals_each_drafters_own_proposals_over_several_steps(llm):
    """Mixed confidences, budgets (0 included) and a sampled request; the caches stay right
    through accepted and rejected drafts, so every later step still agrees."""
    prompts = _prompts(llm)
    params = [SamplingParams(max_tokens=64), SamplingParams(max_tokens=64),
              SamplingParams(max_tokens=64, temperature=0.8, seed=3), SamplingParams(max_tokens=64)]
    confidences = [0.0, 0.4, 0.0, 0.0]
    solo = [_drafter(llm, c) for c in confidences]
    shared = [_drafter(llm, c) for c in confidences]
    solo_seqs = [_seq(p, q, i) for i, (p, q) in enumerate(zip(prompts, params))]
    shared_seqs = [_seq(p, q, i) for i, (p, q) in enumerate(zip(prompts, params))]
    for d, s in zip(solo + shared, solo_seqs + shared_seqs):
        d.begin(s)
    drafted = 0
    for step in range(8):
        ks = [(step + i) % (K + 1) for i in range(4)]
        alone = [d.propose(s, k) for d, s, k in zip(solo, solo_seqs, ks)]
        together = draft_batch(list(zip(shared, shared_seqs, ks)))
        for i, (a, b) in enumerate(zip(alone, together)):
            assert b.tokens.tolist() == a.tokens.tolist(), (step, i)
            assert (a.probs is None) == (b.probs is None)
            if a.probs is not None:
                torch.testing.assert_close(b.probs, a.probs, atol=1e-4, rtol=1e-4)
            drafted += a.k
            n_accepted = (step * 3 + i) % (a.k + 1)
            new = a.tokens[:n_accepted].tolist() + [(step * 7 + i) % 200]
            for d, s in ((solo[i], solo_seqs[i]), (shared[i], shared_seqs[i])):
                s.token_ids += new
                d.accept(s, n_accepted)
            assert shared[i].cache.length == solo[i].cache.length
    assert drafted > 20


def test_draft_batch_groups_by_model(llm):
    """Drafters of different draft models in one call each get their own model's drafts."""
    other = Decoder.from_dir(llm.model_dir, role="draft")  # the target's weights: other drafts
    prompts = _prompts(llm)[:2]
    params = SamplingParams(max_tokens=32)
    pairs = [(DraftModelDrafter(m, llm.target.config.vocab_size, 128), _seq(p, params))
             for m in (llm.draft_model, other) for p in prompts]
    for d, s in pairs:
        d.begin(s)
    together = draft_batch([(d, s, K) for d, s in pairs])
    assert together[0].tokens.tolist() != together[2].tokens.tolist()  # the two models do differ
    fresh = [(DraftModelDrafter(d.model, llm.target.config.vocab_size, 128), s) for d, s in pairs]
    for (d, s), got in zip(fresh, together):
        d.begin(s)
        assert got.tokens.tolist() == d.propose(s, K).tokens.tolist()


async def _collect(scheduler: Scheduler, ids: list[int], params: SamplingParams):
    job = scheduler.submit(ids, params)
    out = None
    async for event in job:
        out = event.output or out
    return out


def _run_concurrently(scheduler: Scheduler, prompts, params):
    async def run_all():
        return await asyncio.gather(*(_collect(scheduler, p, q) for p, q in zip(prompts, params)),
                                    return_exceptions=True)

    try:
        return asyncio.run(run_all())
    finally:
        scheduler.close()


def _solo(llm: LLM, prompts, params):
    return [llm.engine.generate(p, q, llm.new_drafter("draft_model"), spec_k(K, adaptive=False))
            for p, q in zip(prompts, params)]


def test_concurrent_greedy_requests_equal_solo(llm):
    prompts = _prompts(llm)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 9, 22, 40)]
    solo = _solo(llm, prompts, params)
    results = _run_concurrently(Scheduler(llm, method="draft_model", max_concurrency=4), prompts, params)
    assert [out.token_ids for out in results] == [alone.token_ids for alone in solo]
    assert all(out.stats.draft_s > 0 and out.stats.draft_tokens > 0 for out in results)


def test_seeded_sampled_requests_equal_solo_beside_greedy_ones(llm):
    prompts = _prompts(llm)
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=18, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.7, top_k=20, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.2, seed=2, ignore_eos=True)]
    solo = _solo(llm, prompts, params)
    results = _run_concurrently(Scheduler(llm, method="draft_model", max_concurrency=4), prompts, params)
    assert [out.token_ids for out in results] == [alone.token_ids for alone in solo]


def _log_calls(monkeypatch, llm: LLM) -> list[tuple[str, int]]:
    """Record every draft forward ("draft", segments) and target verify ("verify", segments)."""
    calls: list[tuple[str, int]] = []
    draft, target = llm.draft_model, llm.target
    d_forward, d_batch, t_batch = draft.forward, draft.forward_batch, target.forward_batch
    inside = []  # a draft forward that calls forward_batch is one forward

    def draft_forward(tokens, cache, last_only=False, tree=None, capture=None):
        calls.append(("draft", 1))
        inside.append(True)
        try:
            return d_forward(tokens, cache, last_only, tree, capture)
        finally:
            inside.pop()

    def draft_batch_forward(segments, last_only=False, trees=None, captures=None):
        if not inside:
            calls.append(("draft", len(segments)))
        return d_batch(segments, last_only, trees, captures)

    def verify(segments, last_only=False, trees=None, captures=None, invariant=False):
        calls.append(("verify", len(segments)))
        return t_batch(segments, last_only, trees, captures, invariant)

    monkeypatch.setattr(draft, "forward", draft_forward)
    monkeypatch.setattr(draft, "forward_batch", draft_batch_forward)
    monkeypatch.setattr(target, "forward_batch", verify)
    return calls


def test_three_requests_share_each_draft_forward(llm, monkeypatch):
    """Drafting K tokens costs K draft forwards a step (catch-up, then K - 1) for the three
    requests together, not 3K; a newcomer's prompt catch-up adds one forward, once."""
    prompts = _prompts(llm)[1:]
    params = [SamplingParams(max_tokens=40, ignore_eos=True) for _ in prompts]
    solo = _solo(llm, prompts, params)
    calls = _log_calls(monkeypatch, llm)
    results = _run_concurrently(Scheduler(llm, method="draft_model", max_concurrency=3), prompts, params)
    assert [out.token_ids for out in results] == [alone.token_ids for alone in solo]
    steps, drafts = [], 0  # the draft forwards before each verify with all three requests
    for kind, n in calls:
        if kind == "draft":
            drafts += 1
        else:
            if n == 3:
                steps.append(drafts)
            drafts = 0
    assert len(steps) >= 5
    assert max(steps) <= K + 1 < 3 * K
    assert sorted(steps)[len(steps) // 2] == K
    assert ("draft", 3) in calls


def test_a_failing_shared_draft_forward_fails_its_requests_only(llm, monkeypatch):
    """The two requests first drafting together get the error; the third, still prefilling
    then (prompts join one chunk per scheduler turn), drafts alone afterwards and completes; the
    server keeps serving."""
    prompts = _prompts(llm)[1:]
    params = [SamplingParams(max_tokens=20, ignore_eos=True) for _ in prompts]
    solo = _solo(llm, prompts, params)
    scheduler = Scheduler(llm, method="draft_model", max_concurrency=3)
    forward_batch = llm.draft_model.forward_batch

    def broken(segments, last_only=False, trees=None, captures=None):
        if len(segments) > 1:
            raise RuntimeError("draft forward broke")
        return forward_batch(segments, last_only, trees, captures)

    monkeypatch.setattr(llm.draft_model, "forward_batch", broken)

    async def run():
        first = await asyncio.gather(*(_collect(scheduler, p, q) for p, q in zip(prompts, params)),
                                     return_exceptions=True)
        monkeypatch.undo()
        return first, await _collect(scheduler, prompts[0], params[0])

    try:
        first, later = asyncio.run(run())
    finally:
        scheduler.close()
    failed = [i for i, r in enumerate(first) if isinstance(r, RuntimeError) and "broke" in str(r)]
    assert len(failed) == 2
    (ok,) = set(range(3)) - set(failed)
    assert first[ok].token_ids == solo[ok].token_ids
    assert later.token_ids == solo[0].token_ids


def test_combined_and_tree_requests_share_the_draft_models_forwards(tiny_pair, monkeypatch):
    """Drafters that wrap the draft model (combined, tree) draft in the same forwards as plain
    draft_model requests: no step runs more draft forwards than its deepest draft needs."""
    target, draft = tiny_pair
    # combined copies only after long matches here, so it drafts with the model at first
    llm = LLM(model=str(target), draft=str(draft), method="draft_model", num_speculative_tokens=K,
              adaptive=False, draft_confidence=0.0, max_seq_len=256, progress=False, combined_min_match=8)
    prompts = _prompts(llm)[1:]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    methods = ["draft_model", "combined", "tree"]
    solo = [llm.engine.generate(p, params, llm.new_drafter(m), spec_k(K, adaptive=False)) for p, m in zip(prompts, methods)]
    llm.suffix_history.clear()  # else combined copies the solo runs' answers all the way
    calls = _log_calls(monkeypatch, llm)
    batch = Batch(llm.target, FixedK())
    for p, m in zip(prompts, methods):
        batch.add(llm.engine.begin(p, params, llm.new_drafter(m, 128), spec_k(K, adaptive=False),
                                   llm.target.new_cache(128)))
    outputs = {}
    while len(batch):
        outcome = batch.step()
        assert not outcome.failed
        outputs.update({id(m): e.output for m, e in outcome.events if e.output is not None})
    assert sorted(o.token_ids for o in outputs.values()) == sorted(o.token_ids for o in solo)
    assert ("draft", 3) in calls, str(calls)  # one forward served all three drafters


def test_a_cancelled_request_leaves_before_drafting(llm):
    """A cancelled request leaves the batch at the next step without drafting: its draft cache
    stays as it was; the others draft K each."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    batch, cancelled = Batch(llm.target, FixedK()), [False] * 3
    members = [batch.add(llm.engine.begin(ids, params, llm.new_drafter("draft_model", 64), spec_k(K, adaptive=False),
                                          llm.target.new_cache(64)), cancelled=lambda i=i: cancelled[i])
               for i, ids in enumerate(_prompts(llm)[:3])]
    while any(m.prefilling for m in members):
        batch.step()
    before = members[1].gen.drafter.cache.length
    cancelled[1] = True
    outcome = batch.step()
    assert outcome.left == [members[1]] and not outcome.failed and not outcome.events[0][0] is members[1]
    assert members[1].gen.drafter.cache.length == before
    assert [m.gen.proposal.k for m in (members[0], members[2])] == [K, K]


def test_the_step_trace_records_each_steps_times_and_drafts(llm, tmp_path, monkeypatch):
    """SPECDECODE_STEP_TRACE: a line a step, whose parts fit in its wall time and whose requests'
    planned, drafted and kept drafts add up to the tokens the requests got."""
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(trace.ENV, str(path))
    monkeypatch.setattr(trace, "_TRACE", None)
    prompts = _prompts(llm)[2:]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 7)]
    batch = Batch(llm.target, FixedK())
    for p, q in zip(prompts, params):
        batch.add(llm.engine.begin(p, q, llm.new_drafter("draft_model"), spec_k(K, adaptive=False)))
    while len(batch):
        batch.step()
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(steps) >= 2
    for s in steps:
        assert s["step_s"] >= s["prefill_s"] + s["draft_s"] + s["verify_s"] - 1e-6 > 0
        assert s["rows"] == sum(r["drafted"] + 1 for r in s["requests"])
        assert all(r["planned"] == K or r["drafted"] < K for r in s["requests"] if r["source"])
    decoded = [s for s in steps if s["requests"]]
    assert sum(s["draft_s"] > 0 and s["rows"] > len(s["requests"]) for s in decoded) >= len(decoded) - 2  # FixedK: all but the last steps draft
    # every token after the first (picked from the prompt's logits) came from a traced step
    assert sum(r["accepted"] + 1 for s in decoded for r in s["requests"]) == sum(q.max_tokens for q in params) - 2


def test_a_run_measures_the_costs_its_policy_plans_on(llm):
    """The engine's steps teach the default policy its costs (the other tests plan on
    ``conftest.CostTable``): a one-row step's seconds, an extra verify row's share of it (from
    consecutive steps of different rows), and the drafter's seconds per drafted token."""
    policy = CostModel(StepCosts())
    batch = Batch(llm.target, policy)
    batch.add(llm.engine.begin(_prompts(llm)[3], SamplingParams(max_tokens=16, ignore_eos=True),
                               llm.new_drafter("draft_model"), spec_k(K)))
    while len(batch):
        batch.step()
    costs = policy.costs
    assert costs.verify_measured and costs.step_s > 0
    assert costs.row_share != ROW_SHARE_PRIOR and 0 <= costs.row_share <= MAX_SHARE
    assert costs.draft_token_steps.get("draft_model", 0) > 0


def test_a_shared_forward_is_charged_evenly_and_recorded_as_the_lone_forward_it_stands_for(monkeypatch):
    """Two requests' calls in one forward: each is charged half its time (its stats), and the
    policy's record counts it as the lone forward it replaced, the forward's time over
    ``shared_forward(2)``; a call alone counts its whole time in both."""
    from specdecode.drafters.base import ModelCall
    from specdecode.engine import drafting
    from specdecode.engine.costs import shared_forward

    clock = [0.0]
    monkeypatch.setattr(drafting.time, "perf_counter", lambda: clock[0])

    class Model:  # a forward takes 0.06 s of the fake clock; the coroutines' own steps take none
        def forward(self, tokens, cache, last_only=False):
            clock[0] += 0.06
            return torch.zeros(1, 4)

        def forward_batch(self, segments, last_only=False):
            clock[0] += 0.06
            return [torch.zeros(1, 4) for _ in segments]

    model = Model()

    def coroutine():
        yield ModelCall(model, torch.tensor([1]), None)
        return DraftProposal(torch.tensor([1]), None)

    pair, alone = [DraftWork(coroutine()), DraftWork(coroutine())], [DraftWork(coroutine())]
    draft_all(pair)
    draft_all(alone)
    assert [w.seconds for w in pair] == pytest.approx([0.03, 0.03])
    assert [w.solo_s for w in pair] == pytest.approx([0.06 / shared_forward(2)] * 2)
    assert alone[0].seconds == pytest.approx(0.06) and alone[0].solo_s == pytest.approx(0.06)
