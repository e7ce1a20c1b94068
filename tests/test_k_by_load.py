"""K by load: the table's parsing, and the scheduler capping every step's drafts by the number of
requests running without changing any output."""

from __future__ import annotations

import pytest

from specdecode.params import SamplingParams
from specdecode.errors import InvalidConfigError
from specdecode.server.k_by_load import KSchedule, parse_k_by_load
from specdecode.server.scheduler import Scheduler
from tests.conftest import spec_k
from tests.test_scheduler import _prompts, _run_concurrently, llm  # noqa: F401 - the module's fixture


def test_the_table_reads_like_vllms():
    table = KSchedule.parse("1-2:12, 3-4:6,5-:0")
    assert [table.cap(n) for n in range(1, 9)] == [12, 12, 6, 6, 0, 0, 0, 0]
    assert KSchedule.parse("2:3").cap(2) == 3 and KSchedule.parse("2:3").cap(1) is None  # unlisted: -k
    assert parse_k_by_load(None) is None and parse_k_by_load("auto") is None  # the policy alone


@pytest.mark.parametrize("bad", ["1-2", "a:3", "0:4", "3-1:2", "1-4:2,3-:0", "1-:2,5:0", "1:99", ""])
def test_bad_tables_are_refused(bad):
    with pytest.raises(InvalidConfigError):
        KSchedule.parse(bad)


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
    running: list[int] = []
    real_cap = KSchedule.cap
    monkeypatch.setattr(KSchedule, "cap", lambda self, n: running.append(n) or real_cap(self, n))
    scheduler = Scheduler(llm, method="ngram", max_concurrency=4, k_by_load=KSchedule.parse("1:4,2-3:1,4-:0"))
    results = _run_concurrently(scheduler, prompts, params)
    assert 4 in running  # prompts still prefilling are counted: four admitted before all decode
    assert [out.token_ids for _, out in results] == [alone.token_ids for alone in solo]
    limit = {1: 5, 2: 2, 3: 2, 4: 1}  # rows per request: K + 1
    assert all(max(rows) <= limit[len(rows)] for rows in seen), seen
    assert any(len(rows) == 4 for rows in seen) and any(len(rows) == 1 and rows[0] > 1 for rows in seen)


def test_the_k_by_load_gauge_shows_the_last_steps_cap():
    from prometheus_client import generate_latest

    from specdecode.server.metrics import ServerMetrics

    class Load:
        running, waiting, step_k = 0, 0, None

    metrics = ServerMetrics(Load, "m", "draft_model", 12)
    assert "specdecode_k_by_load 12.0" in generate_latest(metrics.registry).decode()  # before any step: the server's K
    Load.step_k = 3
    assert "specdecode_k_by_load 3.0" in generate_latest(metrics.registry).decode()
