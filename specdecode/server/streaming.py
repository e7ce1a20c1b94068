"""Following one scheduler job to its end, or cancelling it when the client leaves.

A generation holds a scheduler slot (and KV memory) until it finishes, so a client that goes away
must stop it at once. Both response paths watch the connection while the job runs: streams with
:class:`EventStreamResponse` (it listens for ``http.disconnect`` beside the writer, whatever ASGI
spec version the server speaks), plain responses with :func:`collect`. Either way the events of a
job pass through :meth:`TrackedJob.events`, whose ``finally`` cancels a job that did not finish
and which records the timings and statistics of one that did. A request for several samples of
one prompt (``n`` > 1) has a job per sample, followed together by :func:`merged`: a client that
leaves, or an error in one of them, stops them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specdecode.engine.generation import GenerationOutput, StreamEvent
from specdecode.server.http_errors import APIError
from specdecode.server.metrics import ServerMetrics


class Job(Protocol):
    """The scheduler's handle on one request (see ``scheduler.Job``)."""

    def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[StreamEvent]: ...


class TrackedJob:
    """A job plus what its response and the metrics need: timings and the final output."""

    def __init__(self, job: Job, metrics: ServerMetrics) -> None:
        self.job, self.metrics = job, metrics
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.output: GenerationOutput | None = None

    async def events(self) -> AsyncIterator[StreamEvent]:
        """The job's events; raises what the engine raised. Closing this early cancels the job."""
        outcome = "cancelled"
        source = aiter(self.job)
        try:
            async for event in source:
                now = time.perf_counter()
                if event.token_ids and self.first_token_at is None:
                    self.first_token_at = now
                if event.output is not None:
                    outcome = "done"
                    self.output = event.output
                    ttft = None if self.first_token_at is None else self.first_token_at - self.submitted
                    self.metrics.finished(event.output, ttft, now - self.submitted)
                yield event
            if self.output is None:
                outcome = "error"
                raise APIError(503, "the generation stopped before finishing (is the server shutting down?)",
                               type="server_error", code="generation_aborted")
        except Exception:
            if outcome != "done":
                outcome = "error"
            raise
        finally:
            if outcome == "cancelled":  # closed early: GeneratorExit or task cancellation
                self.job.cancel()
                self.metrics.cancelled.inc()
            close = getattr(source, "aclose", None)
            if close is not None:  # leave no suspended generator behind for the garbage collector
                await close()


async def merged(tracked: Sequence[TrackedJob]) -> AsyncIterator[tuple[int, StreamEvent]]:
    """The events of ``tracked`` (the samples of one request) as they come, each with its job's
    index; ends when every job has ended, raises the first error any of them meets. Closing it
    early, or an error, cancels every job still running."""
    queue: asyncio.Queue[tuple[int, StreamEvent | BaseException | None]] = asyncio.Queue()

    async def follow(index: int, job: TrackedJob) -> None:
        try:
            async with contextlib.aclosing(job.events()) as events:
                async for event in events:
                    queue.put_nowait((index, event))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, None))

    followers = [asyncio.ensure_future(follow(i, job)) for i, job in enumerate(tracked)]
    try:
        running = len(followers)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:  # a job still running is abandoned: its follower's cancellation cancels the job
        for follower in followers:
            follower.cancel()
        await asyncio.gather(*followers, return_exceptions=True)


async def collect(tracked: Sequence[TrackedJob], receive: Receive) -> list[GenerationOutput] | None:
    """Run the jobs of one request to their outputs; None (and the jobs cancelled) if the client
    disconnects first."""

    async def run() -> list[GenerationOutput] | None:
        async with contextlib.aclosing(merged(tracked)) as events:
            async for _ in events:
                pass
        return [job.output for job in tracked if job.output is not None]

    task = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping this handler: stop the job too
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():  # the client left first
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


KEEPALIVE_EVERY_S = 2.0


async def with_keepalives(content: AsyncIterator[str], every: float = KEEPALIVE_EVERY_S) -> AsyncIterator[str]:
    """``content``, with an SSE comment line whenever the next event takes longer than ``every``
    seconds (a long prompt's prefill). Clients skip comments; the writes keep proxies from timing
    the stream out and show a client that left (its reset fails the next write) while no token
    flows. Closing this closes ``content``."""
    source = aiter(content)
    pending: asyncio.Future[str] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield ": keep-alive\n\n"
                continue
            arrived, pending = pending, None
            try:
                item = arrived.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:  # the next event was being waited for: stop that wait first
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        close = getattr(source, "aclose", None)
        if close is not None:
            await close()


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` that stops writing, and closes its event source (cancelling the job),
    as soon as the client disconnects; a comment line every ``KEEPALIVE_EVERY_S`` without events."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(with_keepalives(content, KEEPALIVE_EVERY_S), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def first_to_end(step: Callable[[], Awaitable[Any]]) -> None:
                    with contextlib.suppress(OSError):  # writing to a closed connection
                        await step()
                    group.cancel_scope.cancel()

                group.start_soon(first_to_end, lambda: self.stream_response(send))
                group.start_soon(first_to_end, lambda: self.listen_for_disconnect(receive))
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
