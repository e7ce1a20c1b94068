"""Runs server requests on one loaded model, off the event loop.

The HTTP layer calls :meth:`Scheduler.submit` from the asyncio loop and iterates the returned
:class:`Job`'s events; generation happens on one worker thread, because torch calls block and the
model can only run one forward at a time anyway. A bounded wait queue turns overload into an
immediate :class:`ServerBusyError` (HTTP 429) instead of unbounded latency. Cancelling a job
(client disconnect) stops its generation at the next step and frees its slot.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from specdecode.api import LLM
from specdecode.config import SamplingParams
from specdecode.engine import StreamEvent
from specdecode.errors import ServerBusyError

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
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        while True:
            item = await self.events.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Scheduler:
    """A bounded queue in front of the engine.

    ``max_concurrency``: requests generating at once; ``max_queue``: requests allowed to wait
    beyond those. ``running`` and ``waiting`` feed the server's gauges.
    """

    def __init__(self, llm: LLM, method: str | None = None, k: int | None = None,
                 max_concurrency: int = 4, max_queue: int = 64) -> None:
        if max_concurrency < 1 or max_queue < 0:
            raise ValueError("need max_concurrency >= 1 and max_queue >= 0")
        self.llm, self.method = llm, method
        self.k = k or llm.spec.num_speculative_tokens
        self.max_concurrency, self.max_queue = max_concurrency, max_queue
        self._queue: collections.deque[Job] = collections.deque()
        self._lock = threading.Condition()
        self._running: set[Job] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="specdecode-scheduler", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Job:
        """Queue a request; call from the event loop. Raises ServerBusyError when full."""
        job = Job(list(prompt_ids), params, asyncio.get_running_loop())
        self.llm.engine.check_prompt(job.prompt_ids)
        with self._lock:
            if len(self._queue) + len(self._running) >= self.max_concurrency + self.max_queue:
                raise ServerBusyError(
                    f"server is at capacity ({self.max_concurrency} running, {self.max_queue} waiting); "
                    "retry shortly"
                )
            self._queue.append(job)
            self._lock.notify()
        return job

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=30)

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                self._running.add(job)
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._running.discard(job)

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            job._emit(_DONE)
            return
        try:
            drafter = self.llm.drafter(self.method)
            for event in self.llm.engine.stream(job.prompt_ids, job.params, drafter, self.k,
                                                self.llm.adaptive):
                if job.cancelled.is_set():
                    break
                job._emit(event)
        except Exception as exc:  # delivered to the request's handler, which maps it to HTTP
            job._emit(exc)
        job._emit(_DONE)
