"""Helpers for the server tests: a real uvicorn server on a free loopback port, raw HTTP, metrics."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specdecode.server.scheduler import JobQueue


class LiveServer:
    """Runs an ASGI app with uvicorn in a thread, bound to 127.0.0.1 on a port the OS picks."""

    def __init__(self, app: Any, **config: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)

    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | str | None = None,
                headers: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, dict[str, str], str]:
        """(status, headers, text) of one request; ``body`` is sent as JSON, ``raw`` as is."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        try:
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read().decode("utf-8", "replace")
        finally:
            conn.close()

    def post(self, path: str, body: Any, **kw: Any) -> tuple[int, dict[str, Any]]:
        status, _, text = self.request("POST", path, body, **kw)
        return status, json.loads(text)

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        status, _, text = self.request("GET", "/metrics")
        assert status == 200
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def sse_events(text: str) -> list[str]:
    """The ``data`` payloads of a complete event stream, checking its framing on the way."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    blocks = text.split("\n\n")
    assert blocks[-1] == ""
    events = []
    for block in blocks[:-1]:
        if block.startswith(":"):  # a comment: the server's keep-alive while no event is ready
            continue
        assert block.startswith("data: ") and "\n" not in block, block
        events.append(block[len("data: "):])
    return events


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    """What a raw socket received up to and including ``marker`` (an answer's parts may arrive
    in separate packets); fails if the server closes first."""
    sock.settimeout(30)
    seen = b""
    while marker not in seen:
        chunk = sock.recv(4096)
        assert chunk, seen
        seen += chunk
    return seen


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def assert_openai_error(status: int, body: dict[str, Any], expected_status: int) -> dict[str, Any]:
    assert status == expected_status, body
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


class SlowJobs(JobQueue):
    """Wraps a scheduler so each job's events reach the app ``delay`` seconds apart, and counts
    ``cancel()`` calls: lets a test disconnect while its response is surely unfinished."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay
        self.method, self.k = inner.method, inner.k
        self.submitted = self.cancels = 0

    @property
    def running(self) -> int:
        return self.inner.running

    @property
    def waiting(self) -> int:
        return self.inner.waiting

    @property
    def max_samples(self) -> int | None:
        return self.inner.max_samples

    def submit(self, prompt_ids: list[int], params: Any) -> _SlowJob:
        job = _SlowJob(self.inner.submit(prompt_ids, params), self)
        self.submitted += 1
        return job

    def submit_samples(self, prompt_ids: list[int], params: Any) -> list[_SlowJob]:
        jobs = [_SlowJob(job, self) for job in self.inner.submit_samples(prompt_ids, params)]
        self.submitted += len(jobs)
        return jobs


class _SlowJob:
    def __init__(self, job: Any, owner: SlowJobs) -> None:
        self.job, self.owner = job, owner

    def cancel(self) -> None:
        self.owner.cancels += 1
        self.job.cancel()

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for event in self.job:
            await asyncio.sleep(self.owner.delay)
            yield event
