"""One client address cannot hold every connection, and /health stays reachable past the cap."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from server_support import LiveServer, read_until

from specdecode import LLM
from specdecode.server.app import create_app
from specdecode.server.connections import HEALTH_RESERVE, guarded_protocol
from specdecode.server.scheduler import Scheduler

MODEL = "tiny-pair"
CAP, PER_CLIENT = 8, 3
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture(scope="module")
def llm(tiny_pair) -> LLM:
    return LLM(model=str(tiny_pair[0]), method="none", max_seq_len=128, progress=False)


def _serve(llm: LLM, per_client: int) -> Iterator[LiveServer]:
    scheduler = Scheduler(llm, max_concurrency=1, max_queue=4)
    try:
        with LiveServer(create_app(llm, scheduler, served_model_name=MODEL), timeout_keep_alive=120,
                        http=guarded_protocol(max_connections=CAP, per_client=per_client)) as live:
            yield live
    finally:
        scheduler.close()


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def _held(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A kept-alive connection the server has surely counted: one answered /health on it."""
    sock = _connect(port, source)
    sock.sendall(HEALTH)
    assert read_until(sock, b'"ok"').startswith(b"HTTP/1.1 200")
    return sock


def _answer(sock: socket.socket, request: bytes | None, until: bytes) -> tuple[int, str]:
    if request is not None:
        sock.sendall(request)
    reply = read_until(sock, until).decode()
    return int(reply.split()[1]), reply


def test_one_address_holds_at_most_its_share_and_others_are_served(llm) -> None:
    for live in _serve(llm, PER_CLIENT):
        mine = [_held(live.port) for _ in range(PER_CLIENT)]
        status, reply = _answer(_connect(live.port), None, b"too_many_connections")
        assert status == 503 and "this client holds 3 open connections" in reply
        other = _held(live.port, "127.0.0.2")  # another client is served meanwhile
        mine[0].close()
        again = _held(live.port)  # a freed slot is this client's again
        for sock in [*mine, other, again]:
            sock.close()


def test_health_is_answered_beyond_the_cap_and_nothing_else_is(llm) -> None:
    for live in _serve(llm, 0):
        full = [_held(live.port) for _ in range(CAP)]
        reserve = [_connect(live.port) for _ in range(HEALTH_RESERVE)]
        assert _answer(reserve[0], HEALTH, b'"ok"')[0] == 200
        status, _ = _answer(_connect(live.port), None, b"too_many_connections")  # beyond the reserve too
        assert status == 503
        status, reply = _answer(reserve[1], MODELS, b"too_many_connections")
        assert status == 503
        assert reserve[1].recv(1) == b""  # and closed
        for sock in [*full, *reserve]:
            sock.close()


def test_serve_refuses_a_negative_per_client_limit(capsys) -> None:
    from specdecode.cli import main

    assert main(["serve", "--max-connections-per-client", "-1"]) == 2
    assert "--max-connections-per-client must be >= 0" in capsys.readouterr().err
