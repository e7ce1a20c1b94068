"""Connections no client can hold forever: a deadline for request headers and a connection cap.

uvicorn's HTTP protocol waits without limit for a request's headers: a client that opens a
connection and sends half a request line (or nothing) holds a socket and a file descriptor for
good, before the API key is even looked at, and enough of them exhaust the process's descriptors
so that every request, ``/health`` included, hangs. This subclass of its h11 protocol closes a
connection whose request headers have not all arrived ``header_timeout`` seconds after it opened
(or after its first byte, for a later request on a kept-alive connection), and answers a
connection beyond ``max_connections`` with a JSON 503 at once. One client address may hold at
most ``per_client`` of them, so a single client (or a loop reopening idle sockets) cannot hold
every other one out; and ``HEALTH_RESERVE`` connections beyond the cap serve ``/health`` only, so
a probe still learns that the server is alive when the cap is full. Idle kept-alive connections are
closed by uvicorn's ``timeout_keep_alive``; a body that stalls is the app's to time out
(``app._read_json``). Each cause is logged once a minute with a count, not once per event.

The cap must fit the process's open-file limit (``ulimit -n``): ``connection_cap`` raises the soft
limit toward the hard one and lowers the cap to what fits beside the files already open, so the
server answers 503 before accepting a socket would fail. Where the limit is hit anyway (by
other files), asyncio logs each failed ``accept`` with a traceback, many a second;
``quiet_accept_errors`` folds those into the same once-a-minute count.

A client may half-close its side once its request is sent (``shutdown(SHUT_WR)``, ``nc -N``): HTTP
allows it, and it still wants the answer. uvicorn takes the end of input for a disconnect and
drops the request. Here a connection whose request arrived whole stays open for the response; as
a FIN alone cannot tell a half-close from a client that left, the connection is probed while the
answer is not ready (an interim ``100 Continue`` each second, which HTTP/1.1 clients skip; a
stream's keep-alive comments do the same, ``streaming.EventStreamResponse``). A client that left
answers the probe with a reset, and the next write ends the request as a disconnect.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

log = logging.getLogger("specdecode.server")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0  # for 1 MiB at dial-up speed; a stalled upload ends with 408
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_MAX_PER_CLIENT = 64  # one address's share of the cap; a proxy in front is one address: raise it there
HEALTH_RESERVE = 4  # connections beyond the cap that may ask for /health only
_LOG_EVERY_S = 60.0
_PROBE_EVERY_S = 1.0  # after a half-close: how soon a client that left is noticed (about twice this)


def _busy_response(message: str = "the server has too many open connections; retry shortly") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": "too_many_connections"}}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class _CauseLog:
    """Counts events of one cause and logs them at most once per ``_LOG_EVERY_S``."""

    def __init__(self, message: str) -> None:
        self.message, self.count, self.last = message, 0, float("-inf")

    def event(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= _LOG_EVERY_S:
            log.warning(self.message, self.count)
            self.count, self.last = 0, now


FILES_RESERVE = 64  # descriptors kept for everything but client sockets (models, logs, threads, pipes)


def connection_cap(requested: int) -> tuple[int, str | None]:
    """The connection cap this process can honour, and why it is lower than ``requested`` (None
    when it is not): the soft open-file limit is raised as far as the hard one allows, and the
    cap leaves ``FILES_RESERVE`` descriptors beside those already open."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    opened = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 16
    wanted = requested + opened + FILES_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return requested, None
    cap = soft - opened - FILES_RESERVE
    return cap, (f"--max-connections {requested} lowered to {cap}: this process may open {soft} files "
                 f"(ulimit -n) and {opened + FILES_RESERVE} are kept for the rest")


class _AcceptErrors(logging.Filter):
    """Drops asyncio's per-attempt "socket.accept() out of system resource" records, counting them
    in one once-a-minute line instead."""

    def __init__(self) -> None:
        super().__init__()
        self.cause = _CauseLog("could not accept %d connection(s): the process is out of file descriptors "
                               "(raise ulimit -n or lower --max-connections)")

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("socket.accept() out of system resource"):
            self.cause.event()
            return False
        return True


def quiet_accept_errors() -> None:
    """Install ``_AcceptErrors`` on asyncio's logger (once)."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _AcceptErrors) for f in logger.filters):
        logger.addFilter(_AcceptErrors())


def guarded_protocol(header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
                     max_connections: int = DEFAULT_MAX_CONNECTIONS,
                     per_client: int = DEFAULT_MAX_PER_CLIENT) -> type:
    """uvicorn's h11 protocol with these limits, as a class to pass as ``uvicorn.Config(http=...)``;
    ``per_client`` 0: no limit per address."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    stalled = _CauseLog("closed %d connection(s) that sent no complete request headers within "
                        f"{header_timeout:g} s (--header-timeout)")
    refused = _CauseLog(f"refused %d connection(s) beyond --max-connections {max_connections}")
    crowded = _CauseLog(f"refused %d connection(s) from addresses holding --max-connections-per-client {per_client}")
    held: dict[str, int] = {}  # open connections per client address

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: Any = None
            self._probe_timer: Any = None
            self._half_closed = False

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._refusal: str | None = None
            self._address: str | None = None
            open_now = len(self.connections)
            self._health_only = open_now > max_connections
            self._screen_requests()
            peer = transport.get_extra_info("peername")
            address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
            if open_now > max_connections + HEALTH_RESERVE:
                refused.event()
                self._refuse(transport, _busy_response())
                return
            if per_client and held.get(address, 0) >= per_client:
                crowded.event()
                self._refuse(transport, _busy_response(
                    f"this client holds {per_client} open connections, the most one address may; close idle "
                    "ones or reuse them (keep-alive)"))
                return
            self._address = address
            held[address] = held.get(address, 0) + 1
            self._arm()

        def _refuse(self, transport: Any, response: bytes) -> None:
            transport.write(response)
            transport.close()

        def data_received(self, data: bytes) -> None:
            if not self._in_request():
                self._arm()  # the first bytes of a later request on a kept-alive connection
            super().data_received(data)
            if self._in_request():
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._stop_probing()
            if self._address is not None:
                held[self._address] -= 1
                if not held[self._address]:
                    del held[self._address]
                self._address = None
            super().connection_lost(exc)

        def eof_received(self) -> bool | None:  # type: ignore[override]
            """Keep a half-closed connection open for the answer to its complete request."""
            whole = self._in_request() and not self.cycle.more_body
            if not whole or self.conn.their_http_version != b"1.1":
                return None  # nothing to answer (or a 1.0 client, which 1xx probes would confuse): close
            self._half_closed = True
            self._probe_timer = self.loop.call_later(_PROBE_EVERY_S, self._probe)
            return True

        def send_400_response(self, msg: str) -> None:  # type: ignore[override]
            """uvicorn's answer to a request h11 cannot parse, as a JSON error like every other."""
            import h11

            message = self._refusal or "the request is not valid HTTP/1.1 (request line, headers or framing)"
            body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                         "code": "bad_http"}}).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:  # h11 cannot answer in this state: just close
                pass
            self.transport.close()

        def _screen_requests(self) -> None:
            """Each request as h11 parses it, before the app sees it: one with both Transfer-Encoding
            and Content-Length is refused (400: a proxy in front may frame it by the other header,
            the ground of request smuggling); on a connection beyond the cap, anything but
            ``/health`` is answered 503 and the connection closed."""
            import h11

            next_event = self.conn.next_event

            def checked() -> Any:
                event = next_event()
                if isinstance(event, h11.Request):
                    names = {name.lower() for name, _ in event.headers}
                    if b"transfer-encoding" in names and b"content-length" in names:
                        self._refusal = ("a request may not carry both Transfer-Encoding and Content-Length "
                                         "(ambiguous framing)")
                        raise h11.RemoteProtocolError(self._refusal, 400)
                    if self._health_only and event.target.partition(b"?")[0] != b"/health":
                        refused.event()
                        self._refuse(self.transport, _busy_response())
                        return h11.NEED_DATA  # the connection is closing: nothing more to handle
                return event

            self.conn.next_event = checked

        def _probe(self) -> None:
            self._probe_timer = None
            if not self._in_request() or self.transport.is_closing():
                return
            if not self.cycle.response_started:  # a started response (a stream) is probed by its writes
                import h11

                self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")))
            self._probe_timer = self.loop.call_later(_PROBE_EVERY_S, self._probe)

        def _stop_probing(self) -> None:
            if self._probe_timer is not None:
                self._probe_timer.cancel()
                self._probe_timer = None

        def _in_request(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self._in_request() and not self.transport.is_closing():
                stalled.event()
                self.transport.close()

        def on_response_complete(self) -> None:
            self._disarm()  # uvicorn's keep-alive timer covers the idle time until the next request
            self._stop_probing()
            super().on_response_complete()
            if self._half_closed:  # the client can send no other request
                self.transport.close()

    return GuardedH11Protocol
