"""K by load: the table's parsing, the automatic choice from measured costs, and the scheduler
capping every step's drafts by the number of requests in it without changing any output."""

from __future__ import annotations

import pytest

from specdecode.params import SamplingParams
from specdecode.errors import InvalidConfigError
from specdecode.server.k_by_load import (
    PROBE_AFTER,
    PROBE_K,
    PROBE_MIN_SAMPLES,
    PROBE_SAMPLES,
    PROBE_STEPS,
    AutoK,
    KSchedule,
    StepLoad,
    parse_k_by_load,
)
from specdecode.server.scheduler import Scheduler
from tests.conftest import spec_k
from tests.test_scheduler import _prompts, _run_concurrently, llm  # noqa: F401 - the module's fixture


def test_the_table_reads_like_vllms():
    table = KSchedule.parse("1-2:12, 3-4:6,5-:0")
    assert [table.k_for(StepLoad(n), 12) for n in range(1, 9)] == [12, 12, 6, 6, 0, 0, 0, 0]
    assert KSchedule.parse("2:3").k_for(StepLoad(2), 8) == 3 and KSchedule.parse("2:3").k_for(StepLoad(1), 8) == 8  # unlisted: -k
    assert KSchedule.parse("1-:16").k_for(StepLoad(1), 4) == 4  # never above the server's K
    assert parse_k_by_load(None) is None and isinstance(parse_k_by_load("auto"), AutoK)


@pytest.mark.parametrize("bad", ["1-2", "a:3", "0:4", "3-1:2", "1-4:2,3-:0", "1-:2,5:0", "1:99", ""])
def test_bad_tables_are_refused(bad):
    with pytest.raises(InvalidConfigError):
        KSchedule.parse(bad)


def _measured(verify: dict[int, float], draft_step_s: float, acceptance: float) -> AutoK:
    auto = AutoK()
    for rows, seconds in verify.items():
        auto.record_step(rows, seconds, 0, 0.0)
    auto.record_step(min(verify), verify[min(verify)], 4, 4 * draft_step_s, drafting=1)
    for accepted in _steps_at(acceptance, k=4, n=400):  # as the scheduler reports them: one request-step each
        auto.record_drafts(accepted, int(accepted < 4))
    return auto


def _steps_at(acceptance: float, k: int, n: int) -> list[int]:
    """Accepted drafts of ``n`` steps of ``k`` drafts, each kept with probability ``acceptance``."""
    import random

    rng, out = random.Random(0), []
    for _ in range(n):
        kept = 0
        while kept < k and rng.random() < acceptance:
            kept += 1
        out.append(kept)
    return out


def test_auto_keeps_k_while_verifying_is_flat_and_drops_it_when_rows_cost():
    # A CPU's verify: flat to ~16 rows (one pass over the weights), then linear in rows.
    verify = {r: 0.07 * max(1.0, r / 16) for r in (1, 2, 4, 8, 13, 16, 32, 52, 64, 104)}
    auto = _measured(verify, draft_step_s=0.004, acceptance=0.8)
    assert auto.k_for(StepLoad(1), 12) >= 8  # one request: long drafts are nearly free
    assert auto.k_for(StepLoad(8), 12) <= 1  # eight: every draft row costs a whole row of compute
    assert [auto.k_for(StepLoad(n), 12) for n in (1, 2, 4, 8)] == sorted((auto.k_for(StepLoad(n), 12) for n in (1, 2, 4, 8)), reverse=True)
    assert _measured(verify, 0.004, acceptance=0.01).k_for(StepLoad(1), 12) == 0  # drafts never kept: do not draft


def test_auto_estimates_the_per_draft_acceptance_from_request_steps():
    for rate in (0.3, 0.6, 0.85):
        assert _measured({1: 0.1}, 0.01, rate).acceptance == pytest.approx(rate, abs=0.08)


def test_auto_tries_the_unmeasured_neighbour_of_its_choice():
    auto = _measured({8: 0.15, 32: 0.6}, draft_step_s=0.06, acceptance=0.3)
    picks = [auto.k_for(StepLoad(8), 12) for _ in range(32)]
    assert picks.count(0) == 30 and picks.count(1) == 2  # K=1 (16 rows) every 16th step, until measured
    auto.record_step(16, 0.3, 1, 0.06)
    assert [auto.k_for(StepLoad(8), 12) for _ in range(32)] == [0] * 32


def test_auto_settles_on_measured_costs_from_the_servers_k():
    """This machine's costs (AMD EPYC, 2 cores, the default pair: verify 41 ms for 1 row, +15 ms
    per row; a draft step 13 ms alone, 63 ms for eight): starting at K=12, measuring what it
    picks, auto settles on none for eight requests, and for one too, where the best K (1 or 2)
    promises about 1.07x plain steps, short of MIN_GAIN (the server measured 0.93x there)."""
    def cost(rows: int) -> float:
        return 0.041 + 0.0148 * (rows - 1)

    for running, draft_step, want in ((1, 0.013, (0,)), (8, 0.063, (0,))):
        auto = AutoK()
        auto.record_step(running * 13, cost(running * 13), 12, 12 * draft_step, drafting=running)
        for accepted in _steps_at(0.8, k=12, n=400):
            auto.record_drafts(accepted, int(accepted < 12))
        picks = []
        for _ in range(200):
            k = auto.k_for(StepLoad(running), 12)
            auto.record_step(running * (k + 1), cost(running * (k + 1)), k, k * draft_step, drafting=running * bool(k))
            picks.append(k)
        assert set(picks[-50:]) <= set(want) | {k for k in picks[-50:] if picks[-50:].count(k) <= 4}, picks
        assert max(set(picks[-50:]), key=picks[-50:].count) in want, picks


def test_auto_drafts_only_for_a_clear_gain():
    auto = _measured({1: 0.05, 2: 0.05}, draft_step_s=0.01, acceptance=0.8)
    assert auto.k_for(StepLoad(1), 1) == 1  # 1.8 tokens in 60 ms against 1 in 50: 1.5x
    auto = _measured({1: 0.05, 2: 0.075}, draft_step_s=0.01, acceptance=0.8)
    assert auto._rate(StepLoad(1), 1, auto.acceptance) > auto._rate(StepLoad(1), 0, auto.acceptance)
    assert auto.k_for(StepLoad(1), 1) == 0  # 1.8 tokens in 85 ms: 1.05x, within what the model leaves out


def test_auto_starts_at_the_servers_k_and_interpolates():
    assert AutoK().k_for(StepLoad(4), 7) == 7
    auto = _measured({2: 1.0, 6: 2.0}, 0.01, 0.5)
    assert auto.verify_time(4) == pytest.approx(1.5) and auto.verify_time(12) == pytest.approx(4.0)
    assert auto.verify_time(1) == pytest.approx(0.5)  # below the least measured: in proportion


def test_the_table_counts_prompts_still_prefilling():
    table = KSchedule.parse("1-2:12,3-:0")
    assert table.k_for(StepLoad(decoding=2, admitted=2), 12) == 12
    assert table.k_for(StepLoad(decoding=2, admitted=5), 12) == 0  # a wave is arriving: K is down already


def _warm_single_request() -> AutoK:
    """One request on a flat verify (drafts nearly free), acceptance 0.8: warm, auto drafts long."""
    return _measured({1: 0.05, 2: 0.051, 4: 0.052, 8: 0.055, 13: 0.06}, draft_step_s=0.004, acceptance=0.8)


CATCH_UP_300 = [(300, 0.004 + 300 * 0.002)]  # a 300-token catch-up forward as the draft model times it


def test_auto_learns_the_catch_up_cost_per_token():
    auto = _warm_single_request()
    auto.record_step(5, 0.053, 4, 4 * 0.004 + 300 * 0.002, drafting=1, catch_ups=CATCH_UP_300)
    assert auto.catch_up_token_s == pytest.approx(0.002)  # beyond the draft step the forward also made
    assert auto.draft_step_s == pytest.approx({1: 0.004})  # a catch-up step says nothing of a draft step's time
    assert auto.catch_up_time(StepLoad(2, catch_up=20, catching_up=2)) == pytest.approx(2 * 0.004 + 20 * 0.002)


def test_auto_drafts_after_a_catch_up_only_if_the_requests_live_to_repay_it():
    auto = _warm_single_request()
    auto.record_step(5, 0.053, 4, 4 * 0.004 + 300 * 0.002, drafting=1, catch_ups=CATCH_UP_300)
    assert auto.k_for(StepLoad(1), 12) >= 4  # warm: no catch-up due
    assert auto.k_for(StepLoad(1, catch_up=300, catching_up=1, remaining=256), 12) >= 4  # 0.6 s repaid
    assert auto.k_for(StepLoad(1, catch_up=300, catching_up=1, remaining=8), 12) == 0  # a wave's tail: not repaid


def test_auto_never_explores_into_a_catch_up():
    auto = _measured({8: 0.15, 32: 0.6}, draft_step_s=0.06, acceptance=0.3)
    auto.catch_up_token_s = 0.0  # even a catch-up thought free
    assert [auto.k_for(StepLoad(8, catch_up=800, catching_up=8), 12) for _ in range(64)] == [0] * 64
    assert 1 in [auto.k_for(StepLoad(8), 12) for _ in range(32)]  # warm drafts: the neighbour is tried


def _stale_at_zero() -> AutoK:
    """Drafts would pay (flat verify) but a bad stretch left the acceptance near 0: auto is at K=0."""
    auto = _measured({1: 0.05, 2: 0.051, 3: 0.051, 4: 0.052, 8: 0.055, 13: 0.06}, draft_step_s=0.004, acceptance=0.01)
    assert auto.k_for(StepLoad(1), 12) == 0
    return auto


def test_auto_probes_a_stale_acceptance_and_drafts_again():
    auto = _stale_at_zero()
    assert [auto.k_for(StepLoad(1), 12) for _ in range(PROBE_AFTER - 1)] == [0] * (PROBE_AFTER - 1)  # PROBE_AFTER with the first
    assert auto.k_for(StepLoad(1), 12) == PROBE_K  # the probe: nothing else would ever measure drafts again
    for accepted in _steps_at(0.8, k=PROBE_K, n=PROBE_SAMPLES):
        assert auto.k_for(StepLoad(1), 12) == PROBE_K
        auto.record_drafts(accepted, int(accepted < PROBE_K))
    assert auto.probe is None and auto.acceptance == pytest.approx(0.8, abs=0.15)
    assert auto.k_for(StepLoad(1), 12) >= 4  # the drafter is good again: long drafts are back
    assert auto.probe_after == PROBE_AFTER and auto.idle_steps == 0  # and the next wait starts afresh


def test_auto_probes_ever_less_often_where_drafts_stay_bad():
    auto = _stale_at_zero()
    idle = []  # steps at K=0 before each probe
    for _ in range(3):
        picks = [auto.k_for(StepLoad(1), 12)]
        while picks[-1] == 0:
            picks.append(auto.k_for(StepLoad(1), 12))
        assert picks[-1] == PROBE_K
        idle.append(len(picks) - 1)
        for accepted in _steps_at(0.01, k=PROBE_K, n=PROBE_SAMPLES):
            auto.record_drafts(accepted, int(accepted < PROBE_K))
    assert idle[1:] == [2 * PROBE_AFTER, 4 * PROBE_AFTER]  # still bad after each: the wait doubles


def test_auto_does_not_probe_where_even_perfect_drafts_would_not_pay():
    auto = _measured({r: 0.05 * r for r in range(1, 14)}, draft_step_s=0.01, acceptance=0.9)  # rows cost all
    assert set(auto.k_for(StepLoad(1), 12) for _ in range(4 * PROBE_AFTER)) == {0}
    assert auto.probe is None


def test_a_probe_that_sees_too_few_drafts_ends_and_keeps_the_estimate():
    auto = _stale_at_zero()
    before = auto.acceptance
    picks = [auto.k_for(StepLoad(1), 12) for _ in range(PROBE_AFTER)]
    assert picks[-1] == PROBE_K
    for _ in range(PROBE_MIN_SAMPLES - 1):  # all kept, but too few to say
        auto.record_drafts(PROBE_K, 0)
    picks = [auto.k_for(StepLoad(1), 12) for _ in range(PROBE_STEPS + 4)]
    assert picks.count(PROBE_K) == PROBE_STEPS - 1 and picks[-1] == 0  # PROBE_STEPS steps with the first
    assert auto.probe is None and auto.acceptance == before


def test_a_probe_is_neither_started_nor_kept_for_a_load_that_cannot_repay_it():
    auto = _stale_at_zero()
    auto.catch_up_token_s = 0.002
    tail = StepLoad(1, catch_up=300, catching_up=1, remaining=4)  # a 300-token catch-up, 4 tokens left
    assert set(auto.k_for(tail, 12) for _ in range(2 * PROBE_AFTER)) == {0}
    assert set(auto.k_for(StepLoad(1), 0) for _ in range(2 * PROBE_AFTER)) == {0}  # the server's K is 0
    assert auto.k_for(StepLoad(1), 12) == PROBE_K  # a load that would repay drafts: the probe
    assert auto.k_for(StepLoad(1), 12) == PROBE_K
    assert auto.k_for(tail, 12) == 0 and auto.probe is None  # the tail arrives: the probe ends


def _verify_rows(monkeypatch, llm) -> list[list[int]]:  # noqa: F811
    """Record each verify forward's per-request row counts (prefill chunks run with last_only)."""
    seen: list[list[int]] = []
    real = llm.engine.target.forward_batch

    def spy(segments, last_only=False, *args, **kw):
        if not last_only:
            seen.append([int(tokens.shape[0]) for tokens, _ in segments])
        return real(segments, last_only, *args, **kw)

    monkeypatch.setattr(llm.engine.target, "forward_batch", spy)
    return seen


def test_scheduler_caps_k_by_load_and_outputs_stay_exact(llm, monkeypatch):  # noqa: F811
    prompts = _prompts(llm, 4)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 16, 20, 48)]  # the last ends alone
    solo = [llm.engine.generate(p, q, llm.drafter("ngram"), spec_k(4)) for p, q in zip(prompts, params)]
    seen = _verify_rows(monkeypatch, llm)
    loads: list[StepLoad] = []
    real_k_for = KSchedule.k_for
    monkeypatch.setattr(KSchedule, "k_for", lambda self, load, k_max: loads.append(load) or real_k_for(self, load, k_max))
    scheduler = Scheduler(llm, method="ngram", max_concurrency=4, k_by_load=KSchedule.parse("1:4,2-3:1,4-:0"))
    results = _run_concurrently(scheduler, prompts, params)
    assert any(load.admitted > load.decoding for load in loads)  # prompts still prefilling are counted
    assert [out.token_ids for _, out in results] == [alone.token_ids for alone in solo]
    limit = {1: 5, 2: 2, 3: 2, 4: 1}  # rows per request: K + 1
    assert all(max(rows) <= limit[len(rows)] for rows in seen), seen
    assert any(len(rows) == 4 for rows in seen) and any(len(rows) == 1 and rows[0] > 1 for rows in seen)


def test_auto_scheduler_learns_and_stays_exact(llm, monkeypatch):  # noqa: F811
    prompts = _prompts(llm, 3)
    params = [SamplingParams(max_tokens=30, ignore_eos=True) for _ in prompts]
    solo = [llm.engine.generate(p, q, llm.drafter("draft_model"), spec_k(4)) for p, q in zip(prompts, params)]
    auto = AutoK()
    scheduler = Scheduler(llm, method="draft_model", max_concurrency=3, k_by_load=auto)
    results = _run_concurrently(scheduler, prompts, params)
    assert [out.token_ids for _, out in results] == [alone.token_ids for alone in solo]
    assert auto.verify_s and auto.draft_step_s and 0 < auto.acceptance < 1
    assert auto.catch_up_token_s is not None  # the prompts' catch-ups on the draft model, timed


def test_auto_leaves_the_draft_model_idle_when_catching_up_does_not_pay(llm, monkeypatch):  # noqa: F811
    """Drafts that would first need their draft model to catch up (every request's prompt, here),
    at a cost the requests cannot repay, are never asked for: the draft model never runs, and
    the server's outputs are plain decoding's."""
    prompts = _prompts(llm, 3)
    params = [SamplingParams(max_tokens=20, ignore_eos=True) for _ in prompts]
    plain = [llm.engine.generate(p, q, None, spec_k(1)) for p, q in zip(prompts, params)]
    auto = _measured({r: 0.05 for r in range(1, 40)}, draft_step_s=0.01, acceptance=0.5)  # drafts would pay
    auto.catch_up_token_s = 1.0
    draft = llm.new_drafter("draft_model", 64).model
    calls = []
    for name in ("forward", "forward_batch"):
        real = getattr(draft, name)
        monkeypatch.setattr(draft, name, lambda *a, _real=real, **kw: calls.append(1) or _real(*a, **kw))
    scheduler = Scheduler(llm, method="draft_model", max_concurrency=3, k_by_load=auto)
    results = _run_concurrently(scheduler, prompts, params)
    assert [out.token_ids for _, out in results] == [alone.token_ids for alone in plain]
    assert calls == [] and scheduler.step_k is not None  # the gauge's source is set


def test_the_k_by_load_gauge_shows_the_last_steps_cap():
    from prometheus_client import generate_latest

    from specdecode.server.metrics import ServerMetrics

    class Load:
        running, waiting, step_k = 0, 0, None

    metrics = ServerMetrics(Load, "m", "draft_model", 12)
    assert "specdecode_k_by_load 12.0" in generate_latest(metrics.registry).decode()  # off: the server's K
    Load.step_k = 3
    assert "specdecode_k_by_load 3.0" in generate_latest(metrics.registry).decode()
