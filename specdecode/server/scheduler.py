"""Runs server requests on one loaded model, off the event loop, batching concurrent requests.

The HTTP layer calls :meth:`Scheduler.submit` from the asyncio loop and iterates the returned
:class:`Job`'s events. One worker thread owns the model (torch calls block). It keeps up to
``max_concurrency`` requests active, each with its own KV cache and drafter, and advances them
in lock step: every active request drafts, then ONE target forward verifies all their drafts
(``Decoder.forward_batch``: the rows share each pass over the weights, which is what a decode
step costs on a CPU; acceptance stays ragged per request). Because the target's kernels are
batch-invariant, each request gets exactly the tokens it would get alone. The step loop itself
is the engine's (``engine/batch.py``): this module is a thread, a queue and cancellation.

A new request's prompt runs in chunks (``engine.PREFILL_CHUNK`` tokens), one chunk per loop
turn between the active requests' decode steps, so a long prompt delays the running streams by
one chunk at a time, not by its whole prefill; a request cancelled while its prompt runs stops
at the next chunk. Each request takes its KV cache from the engine's prefix cache and hands it
back when it ends (``models/prefix_cache.py``): a prompt that starts like an earlier request's
prefills only the rest. A request whose cache does not fit the memory budget beside the running
requests' waits at the head of the queue, and no later request overtakes it, until a running one
leaves (first come, first served: a large request is not starved by a stream of small ones); one
that does not fit with nothing running (larger than the whole budget) fails with
:class:`KVCacheFullError` (HTTP 503). A bounded wait queue turns overload into an immediate
:class:`ServerBusyError` (HTTP 429) instead of unbounded latency. Cancelling a job (client
disconnect) drops it at the next step, its cache kept for a retry.

Samples of one prompt (OpenAI's ``n`` and ``best_of``: :meth:`Scheduler.submit_samples`) queue as
one entry and are admitted together, each a job of its own with its own slot: their caches are
taken at once, so the memory budget counts all of them (one that does not fit takes back them
all, to wait or fail as one request), and the first job's prefill serves the others (``Batch.add(...,
shares=first)``): the prompt runs once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdecode.api import LLM
from specdecode.engine.batch import Batch
from specdecode.engine.generation import StreamEvent
from specdecode.engine.openmp import release_pool
from specdecode.errors import KVCacheFullError, ServerBusyError
from specdecode.params import SamplingParams
from specdecode.server.k_by_load import KSchedule

_DONE = object()


@dataclass(eq=False)
class Job:
    """One request's place in the scheduler; async-iterate it for its :class:`StreamEvent`s.

    The last event carries ``output`` (text, tokens, finish_reason, stats). An error raised by the
    engine (e.g. ``PromptTooLongError``) is re-raised from the iteration.
    """

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating (at the next step) and release the slot."""
        self.cancelled.set()

    def _emit(self, item: object) -> None:  # called from the worker thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            self.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        over = False
        try:
            while True:
                item = await self.events.get()
                if item is _DONE:
                    over = True
                    return
                if isinstance(item, BaseException):
                    over = True
                    raise item
                yield item
        finally:
            if not over:  # the consumer stopped early (closed, cancelled, timed out)
                self.cancel()


class JobQueue(ABC):
    """What the app needs from a scheduler, with defaults: ``method`` and ``k`` None mean the
    LLM's own; a queue is ``alive`` unless it says otherwise."""

    method: str | None = None
    k: int | None = None
    running: int = 0  # requests generating now
    waiting: int = 0  # requests queued behind them
    step_k: int | None = None  # the most drafts the policy allowed a request in the last step (None: no step yet)
    max_samples: int | None = None  # the most samples of one prompt submit_samples takes (None: no limit)

    @property
    def alive(self) -> bool:
        """False once the queue can run nothing more; feeds ``/health``."""
        return True

    @abstractmethod
    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        """Queue a request: a job to iterate for its ``StreamEvent``s, and to ``cancel()``."""

    def submit_samples(self, prompt_ids: list[int], params: Sequence[SamplingParams]) -> list[Any]:
        """Queue samples of one prompt, one job per ``params``; by default independent requests,
        all queued or none."""
        jobs: list[Any] = []
        try:
            for p in params:
                jobs.append(self.submit(prompt_ids, p))
        except BaseException:
            for job in jobs:
                job.cancel()
            raise
        return jobs


class Scheduler(JobQueue):
    """A bounded queue in front of the engine.

    ``max_concurrency``: requests generating at once; ``max_queue``: requests allowed to wait
    beyond those; ``k_by_load``: a cap on K by running requests (``k_by_load.py``) over the
    engine's speculation policy, which the server's requests share with the LLM's own calls. ``running`` and ``waiting``
    feed the server's gauges.
    """

    def __init__(self, llm: LLM, method: str | None = None, k: int | None = None,
                 max_concurrency: int = 4, max_queue: int = 64, k_by_load: KSchedule | None = None) -> None:
        if max_concurrency < 1 or max_queue < 0:
            raise ValueError("need max_concurrency >= 1 and max_queue >= 0")
        self.llm, self.method = llm, method
        self.k = k or llm.spec.num_speculative_tokens
        self.spec = dataclasses.replace(llm.spec, method=method or llm.spec.method, num_speculative_tokens=self.k)
        self.max_concurrency, self.max_queue = max_concurrency, max_queue
        self.max_samples = max_concurrency  # samples of one prompt run at once, a slot each
        self.k_by_load = k_by_load
        self._queue: collections.deque[list[Job]] = collections.deque()  # a request's jobs (samples: several)
        self._lock = threading.Condition()
        self._running: set[Job] = set()
        self._closed = False
        self.memory_waits = 0  # times the queue's head waited for a running request to free memory
        # The steps run on the worker below: an OpenMP pool this thread started since LLM() gave its
        # own back (restoring a prefix cache, say) would make libgomp throttle the worker's barriers.
        # Parallel torch work here later would start one again.
        release_pool()
        self._thread = threading.Thread(target=self._work, name="specdecode-scheduler", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return sum(not job.cancelled.is_set() for jobs in list(self._queue) for job in jobs)

    @property
    def alive(self) -> bool:
        """False once closed or if the worker thread died (a bug); feeds ``/health``."""
        return self._thread.is_alive() and not self._closed

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Job:
        """Queue a request; call from the event loop. Raises ServerBusyError when full."""
        return self.submit_samples(prompt_ids, [params])[0]

    def submit_samples(self, prompt_ids: list[int], params: Sequence[SamplingParams]) -> list[Job]:
        """Queue samples of one prompt, admitted together (see the module docstring); call from the
        event loop. Raises ServerBusyError when they do not all fit the queue, ValueError when
        there are more than ``max_samples``."""
        if not 1 <= len(params) <= self.max_samples:
            raise ValueError(f"{len(params)} samples, but the scheduler runs 1 to {self.max_samples} at once")
        loop = asyncio.get_running_loop()
        jobs = [Job(list(prompt_ids), p, loop) for p in params]
        self.llm.engine.check_prompt(jobs[0].prompt_ids)
        with self._lock:
            if not self.alive:
                raise ServerBusyError("the server is shutting down; retry on another instance")
            self._drop_cancelled_waiters()  # abandoned requests must not hold queue places
            if self._held() + len(jobs) > self.max_concurrency + self.max_queue:
                raise ServerBusyError(
                    f"server is at capacity ({self.max_concurrency} running, {self.max_queue} waiting); "
                    "retry shortly"
                )
            self._queue.append(jobs)
            self._lock.notify()
        return jobs

    def _held(self) -> int:  # holding the lock
        """Places taken: running jobs and queued ones."""
        return len(self._running) + sum(len(jobs) for jobs in self._queue)

    def close(self, timeout: float = 30.0) -> None:
        """Stop: every queued or running request ends at once without an output (the HTTP layer
        answers 503); returns when the worker has finished its current forward, or after
        ``timeout`` seconds."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=timeout)

    def _drop_cancelled_waiters(self) -> None:  # holding the lock
        for jobs in [js for js in self._queue if all(j.cancelled.is_set() for j in js)]:
            self._queue.remove(jobs)
            for job in jobs:
                job._emit(_DONE)

    def _work(self) -> None:
        cap = None if self.k_by_load is None else self.k_by_load.cap
        batch = Batch(self.llm.engine.target, self.llm.engine.policy, cap, self.llm.engine.caches)
        memory_wait = False  # the queue's head waits for a running request to free memory
        while True:
            with self._lock:
                while not self._queue and not len(batch) and not self._closed:
                    self._lock.wait()
                if self._closed:
                    break
                self._drop_cancelled_waiters()
                admitted: list[list[Job]] = []
                slots = self.max_concurrency - len(batch)
                while not memory_wait and self._queue and len(self._queue[0]) <= slots:  # samples start together
                    jobs = self._queue.popleft()
                    self._running.update(jobs)
                    admitted.append(jobs)
                    slots -= len(jobs)
            for i, jobs in enumerate(admitted):
                if not self._begin(batch, jobs):  # no memory until a request leaves: wait, in order
                    self._requeue(admitted[i:])
                    self.memory_waits += 1
                    memory_wait = True
                    break
            try:
                outcome = batch.step()
            except Exception as exc:  # noqa: BLE001 - a bug: fail the requests in hand, keep serving
                for member in batch.drop_all():
                    member.tag._emit(exc)
                    self._release(member.tag)
                memory_wait = False
                continue
            self.step_k = batch.last_k
            for member, event in outcome.events:
                member.tag._emit(event)
            for member, error in outcome.failed:
                member.tag._emit(error)
            for member in outcome.left:
                self._release(member.tag)
            memory_wait = memory_wait and not outcome.left and len(batch) > 0
        with self._lock:  # closed: end everything still here
            left = [member.tag for member in batch.drop_all(kept=True)]
            for job in [j for jobs in self._queue for j in jobs] + left + list(self._running):
                self._release(job)
            self._queue.clear()

    def _begin(self, batch: Batch, jobs: list[Job]) -> bool:
        """Admit ``jobs`` (one request, or samples of one prompt) to ``batch``, each with a cache
        and a drafter of its own. The first cache comes from the prefix cache, which may hold the
        start of the prompt, and the rest of the prompt runs there; the other samples wait for
        that prefill and copy it. False, with nothing taken, when their caches do not fit beside
        the running requests' (they may once one leaves); a request that fails otherwise gets
        its error."""
        try:
            engine, llm, first = self.llm.engine, self.llm, jobs[0]
            capacity = min(engine.max_seq_len, len(first.prompt_ids) + first.params.max_tokens)
            drafters = [llm.new_drafter(self.spec.method, capacity) for _ in jobs]
            gens = engine.begin_samples(first.prompt_ids, [job.params for job in jobs], drafters, self.spec)
        except KVCacheFullError as exc:
            if len(batch):
                return False
            self._fail(jobs, exc)
            return True
        except Exception as exc:  # noqa: BLE001 - delivered to the request's handler, which maps it to HTTP
            self._fail(jobs, exc)
            return True
        leader = batch.add(gens[0], first, first.cancelled.is_set)
        for gen, job in zip(gens[1:], jobs[1:]):
            batch.add(gen, job, job.cancelled.is_set, shares=leader)
        return True

    def _fail(self, jobs: list[Job], exc: BaseException) -> None:
        for job in jobs:
            job._emit(exc)
            self._release(job)

    def _requeue(self, requests: list[list[Job]]) -> None:
        """Put admitted requests back at the head of the queue, in their order."""
        with self._lock:
            for jobs in reversed(requests):
                self._running.difference_update(jobs)
                self._queue.appendleft(jobs)

    def _release(self, job: Job) -> None:
        """Free the job's slot (its cache and drafter go with its Generation) and end its stream."""
        with self._lock:
            self._running.discard(job)
        job._emit(_DONE)
