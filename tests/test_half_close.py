"""A client that half-closes after its request still gets the answer; one that leaves is still noticed."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from server_support import LiveServer, SlowJobs, metric, sse_events, wait_until

from specdecode import LLM
from specdecode.server import streaming
from specdecode.server.app import create_app
from specdecode.server.connections import guarded_protocol
from specdecode.server.scheduler import Scheduler
from specdecode.server.streaming import with_keepalives

MODEL = "tiny-pair"


def _request(max_tokens: int, stream: bool) -> bytes:
    body = {"model": MODEL, "prompt": "a", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": stream}
    data = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    seen = b""
    while chunk := sock.recv(65536):
        seen += chunk
    return seen


@pytest.fixture()
def slow_server(tiny_pair, monkeypatch):
    llm = LLM(model=str(tiny_pair[0]), method="none", max_seq_len=512, progress=False)
    scheduler = Scheduler(llm, max_concurrency=1, max_queue=0)
    slow = SlowJobs(scheduler, delay=0.15)  # 20 tokens take 3 s: the 1 s probes run
    monkeypatch.setattr(streaming, "KEEPALIVE_EVERY_S", 0.1)  # and a stream's keep-alives
    try:
        with LiveServer(create_app(llm, slow, served_model_name=MODEL), http=guarded_protocol()) as server:
            yield server, slow
    finally:
        scheduler.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_half_closed_client_gets_its_answer(slow_server, stream) -> None:
    server, _ = slow_server
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_request(20, stream))
        sock.shutdown(socket.SHUT_WR)  # nothing more to send: `nc -N`, or a client done writing
        reply = _read_all(sock)  # ends when the server closes the connection after the answer
    head, _, payload = reply.rpartition(b"HTTP/1.1 200 OK\r\n")
    assert b"HTTP/1.1 100 Continue\r\n\r\n" in head or stream  # a probe while the answer was not ready
    assert head.replace(b"HTTP/1.1 100 Continue\r\n\r\n", b"") == b""  # nothing but probes before it
    headers, _, content = payload.partition(b"\r\n\r\n")
    if stream:
        text = b"".join(_dechunk(content)).decode()
        events = sse_events(text)
        assert ": keep-alive" in text  # 0.15 s between tokens, a keep-alive every 0.1 s
        chunks = [json.loads(e) for e in events[:-1]]
        assert sum(len(c["choices"][0]["text"]) for c in chunks if c["choices"]) > 0
    else:
        assert json.loads(content)["usage"]["completion_tokens"] == 20


def _dechunk(body: bytes) -> list[bytes]:
    parts = []
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        parts.append(rest[:n])
        body = rest[n + 2:]
    return parts


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_is_still_noticed(slow_server, stream) -> None:
    server, slow = slow_server
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_request(400, stream))
        assert wait_until(lambda: slow.submitted == 1)
    assert wait_until(lambda: slow.cancels == 1, timeout=15)  # the probe's reset: about 2 s
    assert wait_until(lambda: metric(server.metrics(), "specdecode_num_requests_running") == 0)


def test_keepalives_fill_the_gaps_and_closing_closes_the_source() -> None:
    closed = []

    async def slow_events():
        try:
            for i in range(3):
                await asyncio.sleep(0.25)
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    async def run() -> tuple[list[str], list[str]]:
        whole = [item async for item in with_keepalives(slow_events(), every=0.1)]
        stream = with_keepalives(slow_events(), every=0.1)
        first = [await anext(stream), await anext(stream)]
        await stream.aclose()  # the client left while the source waited for its next event
        return whole, first

    whole, first = asyncio.run(run())
    assert [x for x in whole if not x.startswith(":")] == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    assert whole.count(": keep-alive\n\n") >= 3 and not whole[0].startswith("data")
    assert first == [": keep-alive\n\n", ": keep-alive\n\n"] and closed == [True, True]
