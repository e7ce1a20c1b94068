"""A thread done with parallel work gives back its OpenMP workers (engine/openmp.py), so the thread
that steps the model is the only one whose pool counts against the CPUs."""

from __future__ import annotations

import os
import threading
import time

import torch

from specdecode.engine import openmp
from specdecode.server.scheduler import Scheduler


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _gone(tasks: set[str], timeout_s: float = 2.0) -> bool:
    """Whether every thread of ``tasks`` has exited (within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while tasks & _tasks() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not tasks & _tasks()


def test_release_pool_frees_the_calling_threads_workers_and_a_new_region_starts_them_again():
    assert torch.get_num_threads() >= 2, "the project's machines have 2 cores; one thread starts no OpenMP worker"
    seen: dict[str, object] = {}

    def work() -> None:
        before = _tasks()
        torch.ones(1 << 22).sum()  # far above ATen's grain: a parallel region, so this thread's pool
        workers = _tasks() - before
        seen["workers"] = workers
        seen["released"] = openmp.release_pool()
        seen["gone"] = _gone(workers)
        torch.ones(1 << 22).sum()
        seen["again"] = _tasks() - before
        seen["released again"] = openmp.release_pool()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen["workers"], "a parallel region on a new thread starts its pool's workers"
    assert seen["released"] is True and seen["gone"] is True
    assert seen["again"], "the next region starts a new pool"
    assert seen["released again"] is True


def test_release_pool_leaves_other_threads_pools_alone():
    workers: set[str] = set()
    hold, done = threading.Event(), threading.Event()

    def keeps_its_pool() -> None:
        before = _tasks()
        torch.ones(1 << 22).sum()
        workers.update(_tasks() - before)
        hold.set()
        done.wait(30)
        openmp.release_pool()

    t = threading.Thread(target=keeps_its_pool)
    t.start()
    try:
        assert hold.wait(30) and workers
        torch.ones(1 << 22).sum()  # this thread's own pool, then given back
        assert openmp.release_pool() is True
        assert not _gone(workers, timeout_s=0.2), "another thread's workers must survive"
    finally:
        done.set()
        t.join()


def test_release_pool_reports_a_refusal_or_a_missing_libgomp(monkeypatch):
    # omp_pause_resource_all returns nonzero inside a parallel region; release_pool reports it.
    monkeypatch.setattr(openmp, "_find_pause_all", lambda: (lambda kind: -1))
    assert openmp.release_pool() is False
    monkeypatch.setattr(openmp, "_find_pause_all", lambda: None)  # no libgomp loaded, or another runtime
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
