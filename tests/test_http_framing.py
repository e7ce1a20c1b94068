"""Requests h11 cannot parse, and ambiguous framing, get JSON 400s like every other error."""

from __future__ import annotations

import json
import socket

import pytest
from server_support import LiveServer

from specdecode import LLM
from specdecode.server.app import create_app
from specdecode.server.connections import guarded_protocol
from specdecode.server.scheduler import Scheduler

MODEL = "tiny-pair"
BODY = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def server(tiny_pair):
    llm = LLM(model=str(tiny_pair[0]), method="none", max_seq_len=256, progress=False)
    scheduler = Scheduler(llm, max_concurrency=1, max_queue=4)
    try:
        with LiveServer(create_app(llm, scheduler, served_model_name=MODEL), http=guarded_protocol()) as live:
            yield live
    finally:
        scheduler.close()


def _exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


@pytest.mark.parametrize("raw, words", [
    (b"GARBAGE\r\n\r\n", "not valid HTTP"),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}", "not valid HTTP"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", "not valid HTTP"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: "
     + str(len(BODY)).encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + hex(len(BODY))[2:].encode() + b"\r\n"
     + BODY + b"\r\n0\r\n\r\n", "ambiguous framing"),
], ids=["request-line", "no-host", "negative-length", "te-and-cl"])
def test_unparseable_or_ambiguous_requests_get_a_json_400(server, raw, words):
    status, headers, body = _exchange(server.port, raw)
    assert status == 400 and headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    # and the server serves the next, well-formed request
    good = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close"
            b"\r\nContent-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
    status, _, body = _exchange(server.port, good)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
