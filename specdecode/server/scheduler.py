"""Runs server requests on one loaded model, off the event loop, batching concurrent requests.

The HTTP layer calls :meth:`Scheduler.submit` from the asyncio loop and iterates the returned
:class:`Job`'s events. One worker thread owns the model (torch calls block). It keeps up to
``max_concurrency`` requests active, each with its own KV cache and drafter, and advances them
in lock step: every active request drafts, then ONE target forward verifies all their drafts
(``Decoder.forward_batch``: the rows share each pass over the weights, which is what a decode
step costs on a CPU; acceptance stays ragged per request). Because the target's kernels are
batch-invariant, each request gets exactly the tokens it would get alone. Requests drafting with
one draft model share its forwards too (``draft_model.draft_batch``), one per draft step for all
of them; a draft's numerics only decide which drafts the target checks, never the output.

A new request's prompt runs in chunks (``engine.PREFILL_CHUNK`` tokens), one chunk per loop
turn between the active requests' decode steps, so a long prompt delays the running streams by
one chunk at a time, not by its whole prefill; a request cancelled while its prompt runs stops
at the next chunk. A bounded wait queue turns overload into an immediate
:class:`ServerBusyError` (HTTP 429) instead of unbounded latency. Cancelling a job (client
disconnect) drops it at the next step, freeing its KV memory.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from specdecode.api import LLM
from specdecode.params import SamplingParams
from specdecode.sequence import DraftProposal
from specdecode.drafters.draft_model import DraftModelDrafter, draft_batch
from specdecode.engine.generation import Generation, StreamEvent
from specdecode.errors import ServerBusyError
from specdecode.server.k_by_load import HORIZON, AutoK, KSchedule, StepLoad

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
    step_k: int | None = None  # the K cap --k-by-load set for the last step (None: no cap)

    @property
    def alive(self) -> bool:
        """False once the queue can run nothing more; feeds ``/health``."""
        return True

    @abstractmethod
    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        """Queue a request: a job to iterate for its ``StreamEvent``s, and to ``cancel()``."""


class Scheduler(JobQueue):
    """A bounded queue in front of the engine.

    ``max_concurrency``: requests generating at once; ``max_queue``: requests allowed to wait
    beyond those; ``k_by_load``: a cap on K for each step from the load (``k_by_load.py``).
    ``running`` and ``waiting`` feed the server's gauges.
    """

    def __init__(self, llm: LLM, method: str | None = None, k: int | None = None,
                 max_concurrency: int = 4, max_queue: int = 64, k_by_load: KSchedule | AutoK | None = None) -> None:
        if max_concurrency < 1 or max_queue < 0:
            raise ValueError("need max_concurrency >= 1 and max_queue >= 0")
        self.llm, self.method = llm, method
        self.k = k or llm.spec.num_speculative_tokens
        self.spec = dataclasses.replace(llm.spec, method=method or llm.spec.method, num_speculative_tokens=self.k)
        self.max_concurrency, self.max_queue = max_concurrency, max_queue
        self.k_by_load = k_by_load  # K per step from the load (k_by_load.py)
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
        return sum(not job.cancelled.is_set() for job in list(self._queue))

    @property
    def alive(self) -> bool:
        """False once closed or if the worker thread died (a bug); feeds ``/health``."""
        return self._thread.is_alive() and not self._closed

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Job:
        """Queue a request; call from the event loop. Raises ServerBusyError when full."""
        job = Job(list(prompt_ids), params, asyncio.get_running_loop())
        self.llm.engine.check_prompt(job.prompt_ids)
        with self._lock:
            if not self.alive:
                raise ServerBusyError("the server is shutting down; retry on another instance")
            self._drop_cancelled_waiters()  # abandoned requests must not hold queue places
            if len(self._queue) + len(self._running) >= self.max_concurrency + self.max_queue:
                raise ServerBusyError(
                    f"server is at capacity ({self.max_concurrency} running, {self.max_queue} waiting); "
                    "retry shortly"
                )
            self._queue.append(job)
            self._lock.notify()
        return job

    def close(self, timeout: float = 30.0) -> None:
        """Stop: every queued or running request ends at once without an output (the HTTP layer
        answers 503); returns when the worker has finished its current forward, or after
        ``timeout`` seconds."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=timeout)

    def _drop_cancelled_waiters(self) -> None:  # holding the lock
        for job in [j for j in self._queue if j.cancelled.is_set()]:
            self._queue.remove(job)
            job._emit(_DONE)

    def _work(self) -> None:
        active: list[tuple[Job, Generation]] = []  # decoding
        prefilling: list[_Prefill] = []  # admitted, prompt not all in the cache yet (oldest first)
        while True:
            with self._lock:
                while not self._queue and not active and not prefilling and not self._closed:
                    self._lock.wait()
                if self._closed:
                    break
                self._drop_cancelled_waiters()
                admitted = []
                while self._queue and len(active) + len(prefilling) + len(admitted) < self.max_concurrency:
                    job = self._queue.popleft()
                    self._running.add(job)
                    admitted.append(job)
            try:
                prefilling += [p for p in map(self._begin, admitted) if p is not None]
                if prefilling:  # one chunk of one prompt, then everyone's decode step
                    gen = self._prefill_chunk(prefilling[0])
                    if gen is not None or prefilling[0].over:
                        job = prefilling.pop(0).job
                        if gen is not None:
                            active.append((job, gen))
                active = self._step(active, prefilling=len(prefilling))
            except Exception as exc:  # noqa: BLE001 - a bug: fail the requests in hand, keep serving
                for job in [p.job for p in prefilling] + [job for job, _ in active]:
                    job._emit(exc)
                    self._release(job)
                active, prefilling = [], []
        with self._lock:  # closed: end everything still here
            left = [job for job, _ in active] + [p.job for p in prefilling]
            for job in list(self._queue) + left + list(self._running):
                self._release(job)
            self._queue.clear()

    def _begin(self, job: Job) -> _Prefill | None:
        """A newly admitted request's generation, its prompt not yet run; None if it failed."""
        try:
            engine, llm = self.llm.engine, self.llm
            capacity = min(engine.max_seq_len, len(job.prompt_ids) + job.params.max_tokens)
            cache = engine.target.new_cache(capacity)
            gen = engine.begin(job.prompt_ids, job.params, llm.new_drafter(self.spec.method, capacity), self.spec,
                               cache)
            return _Prefill(job, gen, gen.prefill_chunks())
        except Exception as exc:  # noqa: BLE001 - delivered to the request's handler, which maps it to HTTP
            job._emit(exc)
            self._release(job)
            return None

    def _prefill_chunk(self, p: _Prefill) -> Generation | None:
        """Run the next chunk of ``p``'s prompt. Returns the generation once it decodes; sets
        ``p.over`` when the request ended instead (cancelled between chunks, finished at its first
        token, or failed)."""
        job, gen = p.job, p.gen
        try:
            if job.cancelled.is_set():  # the client left: the rest of its prompt is never run
                raise _Cancelled
            logits = self.llm.engine.target.forward(p.chunks[p.next], gen.cache, last_only=True, capture=gen.capture)
            p.next += 1
            if p.next < len(p.chunks):
                return None
            job._emit(gen.start(logits))
            if not gen.finished:
                return gen
            job._emit(gen.finish())
        except _Cancelled:
            pass
        except Exception as exc:  # noqa: BLE001 - delivered to the request's handler, which maps it to HTTP
            job._emit(exc)
        p.over = True
        self._release(job)
        return None

    def _step(self, active: list[tuple[Job, Generation]], prefilling: int = 0) -> list[tuple[Job, Generation]]:
        """Draft for every active request, verify all drafts in one target forward, commit.
        ``prefilling``: admitted requests whose prompts are still running (the load K reads)."""
        t_draft = time.perf_counter()
        feeding: list[Generation] = []  # the requests that draft this step
        if self.k_by_load is not None and active:
            feeding = self._cap_k(active, prefilling)
        active, proposals = self._draft_shared(active)
        batch: list[tuple[Job, Generation, object]] = []
        for job, gen in active:
            try:
                inputs = None if job.cancelled.is_set() else gen.plan(proposals.get(job))
            except Exception as exc:  # noqa: BLE001 - fail this request only, keep serving
                job._emit(exc)
                self._release(job)
                continue
            if inputs is None:  # cancelled, or the context is full
                if not job.cancelled.is_set():
                    job._emit(gen.finish())  # cannot raise: it only packs what is there
                self._release(job)
            else:
                batch.append((job, gen, inputs))
        if not batch:
            return []
        t0 = time.perf_counter()
        draft_s = t0 - t_draft
        try:
            logits = self.llm.engine.target.forward_batch([(inputs, gen.cache) for _, gen, inputs in batch],
                                                          trees=[gen.tree for _, gen, _ in batch],
                                                          captures=[gen.capture for _, gen, _ in batch])
        except Exception as exc:  # a bug, not user input: fail these requests, keep serving
            for job, _, _ in batch:
                job._emit(exc)
                self._release(job)
            return []
        forward_s = time.perf_counter() - t0
        self._record_load(batch, forward_s, draft_s, feeding)
        still: list[tuple[Job, Generation]] = []
        for (job, gen, _), rows in zip(batch, logits):
            try:
                accepted_before = gen.stats.accepted_tokens
                job._emit(gen.commit(rows, forward_s))
                self._record_acceptance(gen, gen.stats.accepted_tokens - accepted_before)
                if not gen.finished:
                    still.append((job, gen))
                    continue
                job._emit(gen.finish())
            except Exception as exc:  # noqa: BLE001 - fail this request only, keep serving
                job._emit(exc)
            self._release(job)
        return still

    def _cap_k(self, active: list[tuple[Job, Generation]], prefilling: int) -> list[Generation]:
        """Set this step's K cap from the load (``k_by_load``); return the requests that will draft."""
        live = [gen for job, gen in active if not job.cancelled.is_set()]
        cap = self.step_k = self.k_by_load.k_for(_step_load(live, prefilling), self.k)
        for gen in live:
            gen.k_cap = cap
        return [gen for gen in live if gen.drafter is not None and gen.draft_budget() > 0]

    def _record_load(self, batch: list[tuple[Job, Generation, Any]], forward_s: float, draft_s: float,
                     feeding: list[Generation]) -> None:
        """Tell the K-by-load policy what this step's verify and drafting cost, with the catch-up
        forwards its drafters ran (as they timed them)."""
        if self.k_by_load is None:
            return
        catch_ups = [timed for gen in feeding if (timed := gen.drafter.pop_catch_up()) is not None]
        draft_steps = max((gen.proposal.depth for _, gen, _ in batch if not gen.forced_step), default=0)
        self.k_by_load.record_step(sum(int(inputs.shape[0]) for _, _, inputs in batch), forward_s, draft_steps,
                                   draft_s, len(feeding), catch_ups)

    def _record_acceptance(self, gen: Generation, accepted: int) -> None:
        """Tell the policy how one request's drafts fared (a refused draft ends its step)."""
        depth = gen.proposal.depth
        if self.k_by_load is not None and depth and not gen.forced_step:  # forced drafts say nothing of the drafter
            self.k_by_load.record_drafts(accepted, int(accepted < depth))

    def _draft_shared(self, active: list[tuple[Job, Generation]]
                      ) -> tuple[list[tuple[Job, Generation]], dict[Job, DraftProposal]]:
        """Draft at once for the requests whose draft models are one model (``draft_batch``), so
        its weights are read once per draft step for all of them. Returns the requests still
        active (a failed shared draft fails just its requests, as a failed target forward does)
        and their proposals; every other request drafts alone in ``plan``. Each request's
        ``draft_s`` gets an even share of the shared drafting time."""
        groups: dict[int, list[tuple[Job, Generation, int]]] = collections.defaultdict(list)
        for job, gen in active:
            if isinstance(gen.drafter, DraftModelDrafter) and not job.cancelled.is_set():
                budget = gen.draft_budget()
                if budget > 0:
                    groups[id(gen.drafter.model)].append((job, gen, budget))
        proposals: dict[Job, DraftProposal] = {}
        failed: set[Job] = set()
        for group in (g for g in groups.values() if len(g) > 1):
            t0 = time.perf_counter()
            try:
                made = draft_batch([(gen.drafter, gen.seq, budget) for _, gen, budget in group])
            except Exception as exc:  # noqa: BLE001 - a bug: fail these requests, keep serving
                for job, _, _ in group:
                    job._emit(exc)
                    self._release(job)
                    failed.add(job)
                continue
            share = (time.perf_counter() - t0) / len(group)
            for (job, gen, _), proposal in zip(group, made):
                gen.stats.draft_s += share
                proposals[job] = proposal
        return [(job, gen) for job, gen in active if job not in failed], proposals

    def _release(self, job: Job) -> None:
        """Free the job's slot (its cache and drafter go with its Generation) and end its stream."""
        with self._lock:
            self._running.discard(job)
        job._emit(_DONE)


def _step_load(gens: list[Generation], prefilling: int) -> StepLoad:
    """The load a step's K is chosen for (see ``StepLoad``): the catch-up of the requests that
    would draft."""
    behind = [n for gen in gens if gen.drafter is not None and gen.draft_budget(capped=False) > 0
              and (n := gen.drafter.catch_up(gen.seq))]
    left = [min(gen.seq.params.max_tokens - gen.seq.num_generated, HORIZON) for gen in gens]
    return StepLoad(len(gens), len(gens) + prefilling, sum(behind), len(behind),
                    sum(left) / len(left) if left else HORIZON)


class _Cancelled(Exception):
    """A job cancelled before its prompt was all run."""


@dataclass(slots=True)
class _Prefill:
    """An admitted request whose prompt runs chunk by chunk between the others' decode steps."""

    job: Job
    gen: Generation
    chunks: list[Any]  # the prompt's prefill chunks (tensors), run in order
    next: int = 0
    over: bool = False
