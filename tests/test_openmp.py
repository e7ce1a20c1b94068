"""A thread done with parallel work gives back its OpenMP workers (engine/openmp.py), so the thread
that steps the model is the only one whose pool counts against the CPUs."""

from __future__ import annotations

import os
import threading
import time

import torch

from specdecode.engine import openmp
from specdecode.server.scheduler import Scheduler


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled(expected: int, timeout_s: float = 2.0) -> int:
    """The process's thread count once it reaches ``expected`` (released workers exit on their own)."""
    deadline = time.monotonic() + timeout_s
    while (n := _threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def test_release_pool_frees_the_calling_threads_workers_and_only_those():
    assert os.cpu_count() >= 2, "the project's machines have 2 cores; one core starts no OpenMP worker"
    counts: dict[str, int] = {}
    released: list[bool] = []

    def work() -> None:
        counts["before"] = _threads()
        torch.ones(1 << 22).sum()  # far above ATen's grain: a parallel region, so this thread's pool
        counts["with pool"] = _threads()
        released.append(openmp.release_pool())
        counts["released"] = _settled(counts["before"])
        torch.ones(1 << 22).sum()  # a new region starts a new pool
        counts["again"] = _threads()
        released.append(openmp.release_pool())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert released == [True, True]
    assert counts["with pool"] > counts["before"]
    assert counts["released"] == counts["before"]
    assert counts["again"] == counts["with pool"]


def test_release_pool_inside_a_parallel_region_refuses(monkeypatch):
    # omp_pause_resource_all returns nonzero there; release_pool reports it rather than raising.
    monkeypatch.setattr(openmp, "_pause_all", lambda: (lambda kind: -1))
    assert openmp.release_pool() is False
    monkeypatch.setattr(openmp, "_pause_all", lambda: None)  # another OpenMP runtime
    assert openmp.release_pool() is False


def test_the_model_and_the_scheduler_release_the_building_threads_pool(tiny_pair, monkeypatch):
    from specdecode import api

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(api, "release_pool", lambda: calls.append(("LLM", threading.get_ident())) or True)
    llm = api.LLM(model=str(tiny_pair[0]), method="none", max_seq_len=64, progress=False)
    from specdecode.server import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "release_pool", lambda: calls.append(("Scheduler", threading.get_ident())) or True)
    scheduler = Scheduler(llm, method="none", max_concurrency=1, max_queue=1)
    try:
        assert calls == [("LLM", threading.get_ident()), ("Scheduler", threading.get_ident())]
        assert scheduler._thread.ident != threading.get_ident()
    finally:
        scheduler.close()


def test_a_servers_grammar_check_releases_its_executor_threads_pool_even_when_refused(monkeypatch):
    from types import SimpleNamespace

    from specdecode.errors import InvalidConstraintError
    from specdecode.server import app

    released: list[int] = []
    monkeypatch.setattr(app, "release_pool", lambda: released.append(threading.get_ident()) or True)

    def refuse(constraint):
        raise InvalidConstraintError("no")

    llm = SimpleNamespace(engine=SimpleNamespace(grammars=SimpleNamespace(check=refuse)))
    try:
        app._check_constraint(llm, None)
    except InvalidConstraintError:
        pass
    else:
        raise AssertionError("the check's refusal must reach the caller")
    assert released == [threading.get_ident()]
