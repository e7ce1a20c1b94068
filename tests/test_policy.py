"""The speculation policy on recorded cost tables: it drafts nothing where drafts cannot pay,
stops where the next draft no longer repays itself, treats solo and batched requests alike,
and learns from the steps it is told about. Pure: no model runs."""

from __future__ import annotations

import dataclasses
import random

import pytest

from specdecode.engine import costs as costs_module, policy as policy_module
from specdecode.engine.costs import (ROW_SHARE_PRIOR, SHARE_CLIP, SHARE_EMA, RequestOutcome, RequestSpeculation, StepCosts, StepTimes,
                                     shared_forward)
from specdecode.engine.policy import (CONTINUATION_ACCEPTANCE, MARGIN, PRIOR_ACCEPTANCE, PROBE_AFTER_MAX, PROBE_K, CostModel,
                                      DraftRequest, FixedK, _draft_seconds)

STEP = 0.040  # one verify row, seconds


def _costs(row_s: float, draft_s: float = 0.0, method: str = "draft_model") -> StepCosts:
    """A verify forward of r rows costs STEP + row_s * (r - 1); drafting ``draft_s`` a token."""
    costs = StepCosts(step_s=STEP, row_share=row_s / STEP)
    costs.draft_token_steps[method] = draft_s / STEP
    return costs


def _request(acceptance: float, k_max: int = 12, method: str = "draft_model", **kw) -> DraftRequest:
    return DraftRequest(method, k_max, room=kw.pop("room", 100), state=RequestSpeculation(acceptance=acceptance), **kw)


def _rate(acceptance: float, k: int, row_s: float, draft_s: float) -> float:
    tokens = sum(acceptance**j for j in range(k + 1))
    return tokens / (STEP + k * (row_s + draft_s))


def test_nothing_is_drafted_where_drafts_cannot_pay():
    """Rows as dear as a step and a draft at 0.4 of one: even 90% acceptance loses."""
    policy = CostModel(_costs(row_s=STEP, draft_s=0.4 * STEP))
    assert policy.draft_lengths([_request(0.9)]) == [0]


@pytest.mark.parametrize("acceptance, row_s, draft_s", [(0.9, 0.013, 0.019), (0.8, 0.005, 0.0), (0.97, 0.010, 0.004),
                                                        (0.6, 0.002, 0.0)])
def test_a_solo_request_drafts_the_k_of_the_best_expected_rate(acceptance, row_s, draft_s):
    """The draft-by-draft choice stops where the next draft no longer repays itself, which for
    one request is the K of the highest expected tokens per second (within the margin)."""
    policy = CostModel(_costs(row_s, draft_s))
    (k,) = policy.draft_lengths([_request(acceptance, k_max=32)])
    rates = [_rate(acceptance, j, row_s, draft_s) for j in range(33)]
    assert k > 0
    assert rates[k] >= max(rates) / MARGIN
    # one more draft would not have paid its way at the margin
    assert acceptance ** (k + 1) * (STEP + k * (row_s + draft_s)) <= MARGIN * sum(acceptance**j for j in range(k + 1)) * (row_s + draft_s)


def test_free_drafts_pay_at_lower_acceptance_than_model_drafts():
    cheap_rows = _costs(row_s=0.012, draft_s=0.0, method="ngram")
    cheap_rows.draft_token_steps["draft_model"] = 0.019 / STEP
    policy = CostModel(cheap_rows)
    free, paid = policy.draft_lengths([_request(0.5, method="ngram")]), policy.draft_lengths([_request(0.5)])
    assert free[0] > 0 and paid == [0]


def test_a_solo_and_a_batched_request_get_the_same_k_at_equal_costs(monkeypatch):
    """Where neither the verify forward nor the draft forward grows with its rows (both
    bandwidth-bound: a shared draft forward costs one lone forward however many requests join
    it), four requests share each verify and draft forward: the step's cost per request is a
    quarter of a lone request's, so each gets the K it gets alone."""
    monkeypatch.setattr(policy_module, "DRAFT_REQUEST_SHARE", 0.0)
    monkeypatch.setattr(costs_module, "DRAFT_REQUEST_SHARE", 0.0)
    costs = _costs(row_s=0.0, draft_s=0.004)
    solo = CostModel(costs).draft_lengths([_request(0.7, shared=True)])
    batched = CostModel(costs).draft_lengths([_request(0.7, shared=True) for _ in range(4)])
    assert solo[0] > 0 and batched == solo * 4


def test_a_shared_draft_forward_is_counted_once():
    """A step's draft seconds count one forward per depth for all the requests of a shared
    model drafting that deep, ``shared_forward`` lone forwards for m of them; a drafter that
    shares nothing pays per token. Eight requests whose shared forward (2.4 lone forwards of
    16 ms) and quarter-step verify rows outweigh what a 0.9 draft adds to an 8-row step draft
    nothing, though the same costs pay for a request alone."""
    costs = _costs(row_s=0.010, draft_s=0.016)
    shared = [_request(0.9, shared=True) for _ in range(3)]
    lone = shared_forward(1)
    assert _draft_seconds(shared, [3, 1, 0], costs) == pytest.approx(0.016 * (shared_forward(2) + 2 * lone))
    assert _draft_seconds([_request(0.9) for _ in range(3)], [3, 1, 0], costs) == pytest.approx(0.016 * 4)
    assert CostModel(costs).draft_lengths([_request(0.9, shared=True) for _ in range(8)]) == [0] * 8
    assert CostModel(costs).draft_lengths([_request(0.9, shared=True)])[0] > 0


def test_two_requests_of_a_shared_draft_model_start_a_depth_together():
    """Beside another request a draft costs a whole draft forward and a row for one token more,
    below the two requests' plain rate; the same depth for both costs 1.2 forwards and two rows
    for two tokens more, which pays: they draft together, where requests that share nothing
    (or each alone in turn) would not draft at all."""
    costs = _costs(row_s=0.004, draft_s=0.016)
    together = CostModel(costs).draft_lengths([_request(0.85, shared=True), _request(0.85, shared=True)])
    apart = CostModel(costs).draft_lengths([_request(0.85), _request(0.85)])
    assert apart == [0, 0] and together[0] == together[1] > 0


def test_a_request_joining_a_deeper_forward_pays_a_share_of_it():
    """A request whose neighbour drafts 6 deep anyway (a fixed K) joins those forwards for a
    fifth of a lone one each, so it drafts deeper than it would with nobody to share them."""
    costs = _costs(row_s=0.004, draft_s=0.016)
    fixed = _request(0.9, k_max=6, adaptive=False, shared=True)
    joined = CostModel(costs).draft_lengths([fixed, _request(0.75, shared=True)])[1]
    alone = CostModel(costs).draft_lengths([dataclasses.replace(fixed, shared=False), _request(0.75)])[1]
    assert joined > alone


def test_a_busier_step_drafts_less_per_request_when_rows_cost_compute():
    policy = CostModel(_costs(row_s=0.008, draft_s=0.0, method="ngram"))
    solo = policy.draft_lengths([_request(0.8, method="ngram")])[0]
    batched = policy.draft_lengths([_request(0.8, method="ngram") for _ in range(8)])
    assert solo > 0 and max(batched) < solo


def test_the_better_request_drafts_more_in_a_batch():
    policy = CostModel(_costs(row_s=0.006, draft_s=0.0, method="ngram"))
    good, poor = policy.draft_lengths([_request(0.9, method="ngram"), _request(0.3, method="ngram")])
    assert good > poor


def test_room_caps_and_fixed_requests():
    policy = CostModel(_costs(row_s=0.0, draft_s=0.0))
    assert policy.draft_lengths([_request(0.9, room=3)]) == [3]
    assert policy.draft_lengths([_request(0.9)], running=5, cap=lambda n: 2 if n >= 4 else None) == [2]
    assert policy.draft_lengths([_request(0.9)], running=1, cap=lambda n: 2 if n >= 4 else None) == [12]
    dear = CostModel(_costs(row_s=STEP, draft_s=STEP))
    assert dear.draft_lengths([_request(0.1, k_max=5, adaptive=False)]) == [5]  # not the policy's to choose
    assert FixedK().draft_lengths([_request(0.0, k_max=7), _request(0.0, room=2)]) == [7, 2]


def test_a_catch_up_is_weighed_against_the_tokens_left():
    costs = _costs(row_s=0.004, draft_s=0.004)
    costs.record(StepTimes(rows=1, verify_s=STEP, catch_ups=[(300, 0.6)]))  # 300 tokens: 0.6 s
    policy = CostModel(costs)
    assert policy.draft_lengths([_request(0.9, catch_up=300, remaining=256)])[0] > 0
    assert policy.draft_lengths([_request(0.9, catch_up=300, remaining=4)]) == [0]


def test_a_request_off_drafting_probes_ever_more_rarely():
    """At 0.5 acceptance its drafts do not pay, at its method's prior (0.8) they would: it
    re-measures now and then, ever more rarely while drafting stays off."""
    policy = CostModel(_costs(row_s=0.010, draft_s=0.012))
    request = _request(0.5)
    picks = [policy.draft_lengths([request])[0] for _ in range(16 + 32 + 64)]
    probes = [i for i, k in enumerate(picks) if k]
    assert [picks[i] for i in probes] == [PROBE_K] * 3
    assert [b - a for a, b in zip(probes, probes[1:])] == [32, 64]
    behind = _request(0.5, catch_up=40)  # a draft model that missed 40 tokens probes too, paying its catch-up
    assert PROBE_K in {policy.draft_lengths([behind])[0] for _ in range(20)}
    policy.costs.record(StepTimes(rows=1, verify_s=STEP, catch_ups=[(40, 20 * STEP)]))  # ... unless it is dear
    dear = _request(0.5, catch_up=40, remaining=100)
    assert {policy.draft_lengths([dear])[0] for _ in range(200)} == {0}
    request.state.probe_after = PROBE_AFTER_MAX
    assert set(policy.draft_lengths([request])[0] for _ in range(PROBE_AFTER_MAX - 1)) == {0}


def test_no_probe_where_no_acceptance_would_make_drafts_pay():
    """Rows as dear as a step: a probe could only confirm that drafting does not pay."""
    policy = CostModel(_costs(row_s=STEP, draft_s=STEP))
    request = _request(0.5)
    assert {policy.draft_lengths([request])[0] for _ in range(200)} == {0}


def test_a_probe_that_pays_alone_waits_in_a_busy_step():
    """The same request probes alone but not beside seven plain requests whose rows (a quarter
    step each) make its step's rate more than a draft at its prior acceptance adds."""
    costs = _costs(row_s=0.010, draft_s=0.012)
    alone, busy = CostModel(costs), CostModel(costs)
    request, crowded = _request(0.5), _request(0.5)
    others = [_request(0.0) for _ in range(7)]
    assert any(alone.draft_lengths([request])[0] for _ in range(40))
    assert not any(busy.draft_lengths([crowded, *others])[0] for _ in range(200))


def test_before_any_measurement_it_drafts_a_little_to_measure():
    assert CostModel().draft_lengths([_request(0.9), _request(0.9, adaptive=False, k_max=5)]) == [PROBE_K, 5]


def test_recorded_steps_teach_acceptance_and_costs():
    policy = CostModel(_costs(row_s=0.005, draft_s=0.0, method="ngram"))
    state = RequestSpeculation()
    request = DraftRequest("ngram", 12, 100, state=state)
    assert policy.draft_lengths([request])[0] > 0  # the method's optimistic prior
    for _ in range(12):  # every first draft refused
        policy.record(StepTimes(rows=5, verify_s=STEP + 4 * 0.005, requests=[RequestOutcome("ngram", state, 4, 0, 0.0)]))
    assert state.acceptance < 0.15 and policy.method_acceptance["ngram"] < 0.8
    assert policy.draft_lengths([request]) == [0]
    fresh = DraftRequest("ngram", 12, 100, state=RequestSpeculation())  # a free copy's: from the method's rate
    assert policy.acceptance(fresh) == pytest.approx(policy.method_acceptance["ngram"])


def test_a_draft_models_request_starts_no_lower_than_its_prior():
    """A drafter that costs time: each new request drafts at its start and gets measured, however
    low earlier requests brought the method's rate (they may have been another kind of text)."""
    policy = CostModel(_costs(row_s=0.005, draft_s=0.004))
    state = RequestSpeculation()
    for _ in range(12):  # an earlier request, every first draft refused
        policy.record(StepTimes(rows=5, verify_s=STEP + 4 * 0.005, requests=[RequestOutcome("draft_model", state, 4, 0, 0.004)]))
    assert policy.method_acceptance["draft_model"] < 0.5
    fresh = DraftRequest("draft_model", 12, 100, draft_cost_prior=0.1)
    assert policy.acceptance(fresh) == pytest.approx(PRIOR_ACCEPTANCE)
    assert policy.draft_lengths([fresh])[0] > 0


def test_a_method_starts_from_its_prior_not_from_its_first_step():
    """One all-refused first step moves the method's acceptance a little, not to zero; a method
    measured above its prior starts new requests there."""
    policy = CostModel(_costs(row_s=0.005))
    state = RequestSpeculation()
    policy.record(StepTimes(rows=3, verify_s=STEP + 0.01, requests=[RequestOutcome("draft_model", state, 2, 0, 0.0)]))
    assert PRIOR_ACCEPTANCE - 0.1 < policy.method_acceptance["draft_model"] < PRIOR_ACCEPTANCE
    for _ in range(8):  # 9 of every 10 drafts kept
        policy.record(StepTimes(rows=11, verify_s=STEP + 0.05, requests=[RequestOutcome("draft_model", state, 10, 9, 0.0)]))
    assert PRIOR_ACCEPTANCE < policy.method_acceptance["draft_model"] < 0.9
    fresh = DraftRequest("draft_model", 12, 100)
    assert policy.acceptance(fresh) == pytest.approx(policy.method_acceptance["draft_model"])


def test_verify_costs_are_a_level_times_a_row_share_learned_from_pairs_of_steps():
    """Each step moves the level; only two consecutive steps of different rows move the share,
    towards the share that puts both at one level."""
    costs = StepCosts()
    assert costs.verify(4) == 0.0 and not costs.verify_measured
    costs.record(StepTimes(rows=1, verify_s=0.040))
    assert costs.verify(3) == pytest.approx(0.040 * (1 + 2 * ROW_SHARE_PRIOR))  # the prior share
    costs.record(StepTimes(rows=5, verify_s=0.040 * (1 + 4 * 0.3)))  # a pair saying 0.3
    share = ROW_SHARE_PRIOR + SHARE_EMA * (0.3 - ROW_SHARE_PRIOR)
    assert costs.row_share == pytest.approx(share)
    assert costs.verify(9) == pytest.approx(costs.step_s * (1 + 8 * share))
    costs.record(StepTimes(rows=5, verify_s=0.200))  # the same rows again: the level moves, not the share
    assert costs.row_share == pytest.approx(share)
    assert costs.verify(5) > 0.080
    costs.record(StepTimes(rows=2, verify_s=0.040))  # 5 rows 5x as long as 2: no share explains it
    assert costs.row_share == pytest.approx(share)
    costs.record(StepTimes(rows=3, verify_s=0.001))  # more rows faster: a pair says "free", moving it at most
    assert costs.row_share == pytest.approx(share - SHARE_EMA * SHARE_CLIP)


def test_the_row_share_tracks_the_pairs_median_through_hiccups():
    """Steps of 1 and 5 rows in turn at 40 ms and 0.2 a row, one in ten slowed 1.3-2.5x (a
    shared host's hiccup): a hiccup's pair says a share far off (up to a whole step, never below
    0), so a plain running mean of the pairs runs high and wide (0.30-0.40 at its highest over
    these seeds); each pair's move clipped, the share stays near the median."""
    for seed in range(4):
        rnd = random.Random(seed)
        costs, shares = StepCosts(), []
        for step in range(400):
            rows = 1 if step % 2 == 0 else 5
            hiccup = rnd.uniform(1.3, 2.5) if rnd.random() < 0.1 else rnd.uniform(0.98, 1.02)
            costs.record(StepTimes(rows=rows, verify_s=0.040 * (1 + 0.2 * (rows - 1)) * hiccup))
            shares.append(costs.row_share)
        late = shares[100:]
        assert 0.13 < min(late) and max(late) < 0.27, seed
        assert sum(late) / len(late) == pytest.approx(0.2, abs=0.015), seed


@pytest.mark.parametrize("spell", [range(0, 4), range(2, 8), range(40, 60)], ids=str)
def test_a_slow_spell_moves_the_level_and_leaves_the_row_share(spell):
    """Steps of 40 ms and 10 ms a row, every forward 1.5x as long for a spell: the share is
    learned from pairs of steps, so the spell cannot make rows look dear and turn drafting
    off (learned from each step against the level, a spell early in a run can hold it at one
    draft a step or none)."""
    rnd = random.Random(1)
    policy, state = CostModel(StepCosts()), RequestSpeculation()
    ks = []
    for step in range(120):
        k = policy.draft_lengths([DraftRequest("draft_model", 12, 100, state=state)])[0]
        accepted = next((j for j in range(k) if rnd.random() > 0.9), k)
        slow = 1.5 if step in spell else 1.0
        seconds = (STEP + 0.010 * k) * slow * rnd.uniform(0.97, 1.03)
        policy.record(StepTimes(rows=k + 1, verify_s=seconds,
                                requests=[RequestOutcome("draft_model", state, k, accepted, 0.008 * k)]))
        ks.append(k)
    assert 0.15 < policy.costs.row_share < 0.35  # 0.25 each extra row
    assert policy.costs.step_s == pytest.approx(STEP, rel=0.1)
    assert min(ks[-40:]) >= 1 and sum(ks[-40:]) / 40 >= 2.4  # 3-4 pay best here


def test_catch_ups_are_read_through_a_line_of_their_sizes():
    """A forward's fixed cost plus a cost per token; from one size alone, never scaled up."""
    costs = StepCosts()
    assert costs.catch_up(100) == 0.0
    costs.record(StepTimes(rows=1, verify_s=STEP, catch_ups=[(8, 0.020)]))  # a few missed tokens
    assert costs.catch_up(4) == pytest.approx(0.010) and costs.catch_up(400) == pytest.approx(0.020)
    costs.record(StepTimes(rows=1, verify_s=STEP, catch_ups=[(408, 0.220)]))  # a prompt's prefill
    assert costs.catch_up(208) == pytest.approx(0.120) and costs.catch_up(8) == pytest.approx(0.020)


def test_a_long_copy_is_picked_over_the_draft_model_and_a_failing_copy_is_not():
    """``pick_sources``: a free copy at good acceptance beats a paid draft at the same; a copy
    that keeps failing loses to the draft model."""
    costs = _costs(row_s=0.008, draft_s=0.012)
    costs.draft_token_steps["suffix/match8"] = 0.0
    policy = CostModel(costs)
    copy, model = _request(0.8, method="suffix/match8"), _request(0.8)
    assert policy.pick_sources([[copy, model]]) == [0]
    assert policy.pick_sources([[_request(0.1, method="suffix/match8"), model]]) == [1]
    # the choice does not depend on the order offered, only ties do
    assert policy.pick_sources([[model, copy]]) == [1]


def test_before_anything_is_measured_a_copy_is_weighed_at_its_match_lengths_prior():
    """A fresh process: a copy after a two-token match (prior 0.5) loses to the draft model at
    the general prior, one after a long match (0.9) wins; the first verified drafts move each
    from its own prior."""
    from specdecode.drafters.suffix import COPY_ACCEPTANCE

    costs = _costs(row_s=0.008, draft_s=0.009)
    for bucket in ("match1", "match16"):
        costs.draft_token_steps[f"suffix/{bucket}"] = 0.0
    policy = CostModel(costs)

    def fresh(bucket: str) -> DraftRequest:
        return _request(None, method=f"suffix/{bucket}", acceptance_prior=COPY_ACCEPTANCE[bucket])

    model = _request(None)
    assert policy.pick_sources([[fresh("match1"), model]]) == [1]
    assert policy.pick_sources([[fresh("match16"), model]]) == [0]
    short = fresh("match1")
    policy.record(StepTimes(rows=3, verify_s=STEP, requests=[RequestOutcome("suffix/match1", short.state, 2, 2)]))
    assert COPY_ACCEPTANCE["match1"] < short.state.acceptance < 0.8  # from 0.5 toward 1.0, not from 0.8


def test_a_request_with_one_source_and_fixed_k_take_the_first():
    policy, fixed = CostModel(_costs(row_s=0.008)), FixedK()
    assert policy.pick_sources([[_request(0.5)]]) == [0]
    assert fixed.pick_sources([[_request(0.1, method="suffix/match1"), _request(0.9)]]) == [0]


def test_one_refused_draft_does_not_turn_drafting_off_but_a_run_of_them_does():
    """A request's acceptance starts from its method's and moves by each decided draft, so one
    unlucky step leaves a good method drafting and a run of refusals stops it."""
    policy = CostModel(_costs(row_s=0.008, draft_s=0.010))
    policy.method_acceptance["draft_model"] = 0.85
    state = RequestSpeculation()
    request = DraftRequest("draft_model", 12, 100, state=state)

    def refused_first_draft() -> None:
        policy.record(StepTimes(rows=4, verify_s=STEP + 3 * 0.008, requests=[RequestOutcome("draft_model", state, 3, 0, 0.03)]))

    refused_first_draft()
    assert 0.7 < state.acceptance < 0.75 and policy.draft_lengths([request])[0] > 0
    for _ in range(4):
        refused_first_draft()
    assert policy.draft_lengths([request]) == [0]


def test_a_spell_of_load_slows_drafts_and_verifies_alike_and_leaves_the_choice_alone():
    """Drafts are costed in the one-row steps measured beside them: while another process
    triples every forward the draft model keeps drafting, and afterwards it is neither held to
    the seconds it cost during the spell nor kept from its quiet K."""
    policy = CostModel(_costs(row_s=0.008, draft_s=0.010))
    request = _request(0.85)
    (k_quiet,) = policy.draft_lengths([request])
    assert k_quiet > 0

    def steps(load: float, drafted: bool) -> None:
        policy.record(StepTimes(rows=1, verify_s=load * STEP))
        if drafted:
            policy.record(StepTimes(rows=1 + k_quiet, verify_s=load * (STEP + 0.008 * k_quiet), requests=[
                RequestOutcome("draft_model", RequestSpeculation(), k_quiet, k_quiet, load * 0.010 * k_quiet)]))

    def as_good_as_quiet() -> bool:  # K within the margin of the best rate at the quiet costs
        (k,) = policy.draft_lengths([request])
        return _rate(0.85, k, 0.008, 0.010) * MARGIN >= max(_rate(0.85, j, 0.008, 0.010) for j in range(13))

    for _ in range(30):  # three times slower, verifies and drafts alike
        steps(3.0, drafted=True)
    assert policy.costs.draft_token(request) == pytest.approx(3 * 0.010, rel=0.05)
    assert as_good_as_quiet()
    for _ in range(30):  # quiet again, plain steps only: the draft model is not measured meanwhile
        steps(1.0, drafted=False)
    assert policy.costs.draft_token(request) == pytest.approx(0.010, rel=0.1)  # not the 0.030 of the spell
    assert as_good_as_quiet()


def test_a_confident_drafter_may_draft_further_and_stops_where_a_further_draft_stops_paying():
    """SpecDec++ priced by the cost model: a drafter that knows its confidence gets a longer
    reach than its average acceptance would give, and a stop that rises with what a further
    draft costs against the step's rate; a drafter without confidence keeps its K."""
    policy = CostModel(_costs(row_s=0.008, draft_s=0.010))
    plain = _request(0.8)
    confident = _request(0.8, confident=True)
    [(k_plain, no_stop)] = policy.plan([plain])
    [(reach, stop)] = policy.plan([confident])
    assert no_stop is None and reach > k_plain > 0
    # the stop: a further draft's expected token (the product so far times the chance that the next
    # survives, no lower than the continuation's) against its cost
    tokens = sum(0.8**j for j in range(k_plain + 1))
    rate = tokens / (STEP + k_plain * (0.008 + 0.010))
    assert stop == pytest.approx(MARGIN * rate * (0.008 + 0.010) / CONTINUATION_ACCEPTANCE)
    surer = _request(0.95, confident=True)  # its own acceptance above the continuation's: that one
    [k_sure] = policy.draft_lengths([dataclasses.replace(surer, confident=False)])
    [(_, sure_stop)] = policy.plan([surer])
    rate = sum(0.95**j for j in range(k_sure + 1)) / (STEP + k_sure * (0.008 + 0.010))
    assert sure_stop == pytest.approx(MARGIN * rate * (0.008 + 0.010) / 0.95)
    dearer = CostModel(_costs(row_s=0.010, draft_s=0.013))
    [(_, dear_stop)] = dearer.plan([confident])
    assert dear_stop > stop
    assert CostModel(_costs(row_s=0.008, draft_s=0.010)).plan([_request(0.8, confident=True, adaptive=False, k_max=5)]) == [(5, None)]


def test_a_catch_up_measured_under_load_never_shuts_its_draft_model_out():
    """A prompt's catch-up timed while another process held the cores is read as no dearer than
    feeding its tokens one forward each, so the draft model still drafts where that pays."""
    costs = _costs(row_s=0.008, draft_s=0.010)
    costs.catch_up_by_size[8] = (200, 200.0)  # 200 tokens in 200 one-row steps: 8 s, a spell of load
    request = _request(0.85, catch_up=200, remaining=512)
    assert CostModel(costs).draft_lengths([request])[0] > 0


def test_a_confident_requests_reach_is_priced_in_its_step():
    """Beside seven plain requests whose rows make its step dearer, a confident request reaches
    less far than alone (the reach is its K at a sure acceptance in the step as planned)."""
    policy = CostModel(_costs(row_s=0.004, draft_s=0.002))
    deep = 40  # a limit neither reach meets
    [(alone, _)] = policy.plan([_request(0.9, confident=True, k_max=deep)])
    [(busy, _), *rest] = policy.plan([_request(0.9, confident=True, k_max=deep), *[_request(0.0) for _ in range(7)]])
    assert 0 < busy < alone < deep and all(k == 0 for k, _ in rest)


def _ran(acceptance: float, drafted: float, kept: float, **kw) -> DraftRequest:
    """A confident request whose drafting steps proposed ``drafted`` and kept ``kept`` on average."""
    r = _request(acceptance, confident=True, **kw)
    r.state.run_drafted, r.state.run_kept = drafted, kept
    return r


def test_a_confident_request_whose_runs_paid_drafts_where_its_acceptance_alone_would_not():
    """Planned at K = 0 on its mean acceptance (a first draft kept 40% of the time), a confident
    request still drafts where its recent drafting steps, each stopped by its own confidence, kept
    enough of what they proposed to beat a plain step at this step's costs; not where they did
    not, nor a request without confidence, nor where the same runs cost more than they give."""
    costs = _costs(row_s=0.008, draft_s=0.012)
    policy = CostModel(costs)
    assert policy.draft_lengths([_request(0.4, confident=True)]) == [0]
    # two drafts a step, 1.4 kept: 1.4 tokens for 2 x 20 ms against 40 ms a token plainly
    [(k, stop)] = policy.plan([_ran(0.4, drafted=2.0, kept=1.4)])
    assert k >= 1 and stop is not None
    assert policy.draft_lengths([_ran(0.4, drafted=2.0, kept=0.6)]) == [0]  # 0.6 for 40 ms: no
    blind = dataclasses.replace(_ran(0.4, drafted=2.0, kept=1.4), confident=False)
    assert policy.draft_lengths([blind]) == [0]
    dear = CostModel(_costs(row_s=0.020, draft_s=0.030))  # the same runs at 50 ms a draft: no
    assert dear.draft_lengths([_ran(0.4, drafted=2.0, kept=1.4)]) == [0]
    # beside seven plain requests whose rows make each extra row dearer, the same runs wait
    busy = CostModel(_costs(row_s=0.008, draft_s=0.012))
    ks = busy.draft_lengths([_ran(0.4, drafted=2.0, kept=1.4), *[_request(0.0) for _ in range(7)]])
    assert ks[0] == 0


def test_recorded_drafting_steps_keep_a_requests_running_means():
    """The steps that drafted make a plain mean of drafts proposed and kept over a request's first
    steps, then a running one (``RUN_EMA``). Drafts decided after a kept one move the request's
    continuation from ``CONTINUATION_ACCEPTANCE``; others leave it."""
    policy = CostModel(_costs(row_s=0.008, draft_s=0.012))
    state = RequestSpeculation(acceptance=0.5)
    policy.record(StepTimes(rows=4, verify_s=0.06, requests=[RequestOutcome("draft_model", state, 3, 2, 0.03)]))
    assert (state.run_drafted, state.run_kept) == (3, 2)
    deeper = 1 - (1 - policy_module.DRAFT_EMA) ** 2  # drafts 2 and 3 decided after the first kept: one kept
    assert state.continuation == pytest.approx(CONTINUATION_ACCEPTANCE + deeper * (0.5 - CONTINUATION_ACCEPTANCE))
    policy.record(StepTimes(rows=2, verify_s=0.05, requests=[RequestOutcome("draft_model", state, 1, 0, 0.01)]))
    assert (state.run_drafted, state.run_kept) == (2, 1)  # the mean of two steps
    continuation = state.continuation
    assert continuation < CONTINUATION_ACCEPTANCE  # a first draft refused says nothing of the next
    for _ in range(2 * int(1 / policy_module.RUN_EMA)):  # one draft a step, kept: no draft after a kept one
        policy.record(StepTimes(rows=2, verify_s=0.05, requests=[RequestOutcome("draft_model", state, 1, 1, 0.01)]))
    assert 1 < state.run_drafted < 1.1 and state.run_kept == pytest.approx(1)
    assert state.continuation == continuation  # no draft after a kept one since


def test_a_confident_stop_trusts_the_requests_own_continuation_once_measured():
    """A low-acceptance confident request stops by the chance that a draft after a kept one
    survives: ``CONTINUATION_ACCEPTANCE`` until its own is measured, then its own."""
    policy = CostModel(_costs(row_s=0.008, draft_s=0.010))
    prior = _request(0.5, confident=True)
    [(_, prior_stop)] = policy.plan([prior])
    doubtful = _request(0.5, confident=True)
    doubtful.state.continuation = 0.6
    [(_, doubtful_stop)] = policy.plan([doubtful])
    assert doubtful_stop == pytest.approx(prior_stop * CONTINUATION_ACCEPTANCE / 0.6)
