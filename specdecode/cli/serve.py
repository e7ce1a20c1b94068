"""``specdecode serve``: the OpenAI-compatible HTTP server (see docs/SERVING.md)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.cli.options import (add_draft_options, add_method_flag, add_method_options, add_model_options,
                                    add_prefix_cache_file_option, add_prefix_cache_options, add_quantize_option,
                                    chosen_method, method_options, restore_prefix_cache, save_prefix_cache)
from specdecode.config import DEFAULT_DTYPE, DEFAULT_MAX_SEQ_LEN, DTYPES
from specdecode.errors import InvalidConfigError
from specdecode.server.k_by_load import parse_k_by_load
from specdecode.server.connections import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                                           DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PER_CLIENT, connection_cap,
                                           guarded_protocol, quiet_accept_errors)

if TYPE_CHECKING:
    from specdecode.api import LLM
    from specdecode.server.scheduler import Scheduler

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    add_method_flag(p, k_help="most draft tokens proposed per step")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s, this machine only; "
                        "0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 endpoints (default: the "
                        "SPECDECODE_API_KEY environment variable; unset = no key)")
    p.add_argument("--metrics-public", action="store_true",
                   help="with --api-key: serve /metrics without the key (for a Prometheus scraper on a "
                        "trusted network); by default it needs the key like /v1 (/health never does)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the --model value)")
    p.add_argument("--max-concurrency", type=int, default=4,
                   help="requests generating at once (default: %(default)s)")
    p.add_argument("--k-by-load", default=None, metavar="START-END:K,...|auto",
                   help="cap K by the number of requests running (prompts still prefilling included), e.g. "
                        "1-2:12,3-4:6,5-:0 (at most 12 drafts for one or two, 6 for three or four, plain decoding "
                        "from five; a count not listed keeps -k), over the speculation policy, which before each "
                        "step picks every request's K (0 included) for the most expected tokens per second from "
                        "the measured verify and draft costs and the acceptance; 'auto' or nothing: the policy "
                        "alone (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait beyond those; more get HTTP 429 (default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=DEFAULT_MAX_SEQ_LEN,
                   help="context length to allocate: prompt plus new tokens (default: %(default)s)")
    add_prefix_cache_options(p)
    add_prefix_cache_file_option(p, "read at start when it exists, written at shutdown (after the last "
                                    "request ends), so a restarted server starts with the prefixes it kept")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body accepted; larger get HTTP 413 (default: %(default)s)")
    p.add_argument("--cors-origin", action="append", default=[], dest="cors_origins", metavar="ORIGIN",
                   help="let web pages from ORIGIN (e.g. http://localhost:3000, or *) call the API from a "
                        "browser; repeatable (default: none)")
    p.add_argument("--allowed-hosts", default="", metavar="NAME[,NAME]",
                   help="host names clients may use to reach the server, comma-separated, or * for any; "
                        "IP addresses and localhost always work. Other names are refused (HTTP 403) so a "
                        "web page cannot read answers by pointing its own name at this server (DNS "
                        "rebinding) (default: none)")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE, help="compute dtype (default: %(default)s)")
    add_draft_options(p)
    add_quantize_option(p)
    add_method_options(p)
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                   help="close a connection whose request headers have not all arrived this long after it "
                        "opened (default: %(default)s)")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                   help="answer 408 when a request body has not all arrived this long after its headers "
                        "(default: %(default)s)")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="open connections at most; more are answered 503 at once and closed, so stalled "
                        "clients cannot exhaust file descriptors (default: %(default)s)")
    p.add_argument("--max-connections-per-client", type=int, default=DEFAULT_MAX_PER_CLIENT, metavar="N",
                   help="open connections one client address may hold; more are answered 503 at once, so "
                        "one client cannot hold the others out (0: no limit; behind a reverse proxy, which "
                        "is one address, raise it or use 0) (default: %(default)s). A few connections "
                        "beyond --max-connections stay open to /health only")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C: stop accepting, give running requests this long to finish, "
                        "then end the rest with HTTP 503 generation_aborted (an error event in streams); "
                        "a second Ctrl-C stops at once (default: %(default)s)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="server log level (default: %(default)s)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    _check(args)
    sock = _listen(args.host, args.port)  # fail fast, before minutes of model loading
    import uvicorn

    from specdecode.api import LLM
    from specdecode.server.app import create_app
    from specdecode.server.scheduler import Scheduler

    method = chosen_method(args)
    llm = LLM(model=args.model, draft=args.draft, method=method, num_speculative_tokens=args.k,
              dtype=args.dtype, max_seq_len=args.max_seq_len, adaptive=not args.fixed_k,
              draft_quantize=args.draft_quantize, draft_confidence=args.draft_confidence,
              draft_temperature=args.draft_temperature, draft_vocab=args.draft_vocab,
              quantize=args.quantize, prefix_cache=args.prefix_cache, kv_cache_memory=args.kv_cache_memory,
              **method_options(args, [method]))
    restore_prefix_cache(llm, args.prefix_cache_file)
    scheduler = Scheduler(llm, method=method, k=args.k, max_concurrency=args.max_concurrency,
                          max_queue=args.max_queue, k_by_load=parse_k_by_load(args.k_by_load))
    app = create_app(llm, scheduler, args.api_key, served_model_name=args.served_model_name,
                     max_body_bytes=args.max_body_bytes, cors_origins=args.cors_origins,
                     allowed_hosts=[h.strip() for h in args.allowed_hosts.split(",") if h.strip()],
                     metrics_public=args.metrics_public, body_timeout=args.body_timeout,
                     on_shutdown=lambda: _save_at_shutdown(llm, scheduler, args.prefix_cache_file))
    if not _is_loopback(args.host) and not args.api_key:
        print(f"specdecode: warning: listening on {args.host} without --api-key: anyone who can reach "
              "this port can use the model", file=sys.stderr)
    name = args.served_model_name or args.model
    print(f"specdecode: serving {name!r} (method {method}, k {args.k}) on "
          f"http://{_url_host(args.host)}:{sock.getsockname()[1]}/v1", file=sys.stderr, flush=True)
    _log_like_uvicorn(args.log_level)
    # uvicorn's own grace outlasts ours, so the requests we end still send their 503 or error event.
    max_connections, lowered = connection_cap(args.max_connections)
    if max_connections < 8:
        raise InvalidConfigError(f"{lowered}, fewer than the 8 a server needs; raise ulimit -n")
    if lowered:
        print(f"specdecode: warning: {lowered}", file=sys.stderr)
    quiet_accept_errors()
    protocol = guarded_protocol(args.header_timeout, max_connections, args.max_connections_per_client)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout + 5,
                            http=protocol, timeout_keep_alive=5)
    server = uvicorn.Server(config)
    threading.Thread(target=_end_requests_after_grace, args=(server, scheduler, args.shutdown_timeout),
                     name="specdecode-shutdown", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        scheduler.close()
    return 0


def _save_at_shutdown(llm: LLM, scheduler: Scheduler, path: Path | None) -> None:
    """The server's last act (its lifespan's end): stop the scheduler, so no request changes the
    kept prefixes any more, then save them when ``--prefix-cache-file`` asks."""
    if path is not None:
        scheduler.close()
        save_prefix_cache(llm, path)


def _end_requests_after_grace(server, scheduler, grace: float) -> None:
    """Once a shutdown begins (uvicorn has stopped accepting), wait for the running and queued
    requests up to ``grace`` seconds, then close the scheduler: what is left ends with 503
    ``generation_aborted`` (a final error event and ``[DONE]`` in streams), not a cut connection."""
    while not server.should_exit:
        time.sleep(0.1)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (scheduler.running or scheduler.waiting):
        time.sleep(0.05)
    left = scheduler.running + scheduler.waiting
    if left:
        logging.getLogger("specdecode.server").warning(
            "shutting down: ending %d request(s) still running after %.1f s (--shutdown-timeout)", left, grace)
    scheduler.close()


def _log_like_uvicorn(level: str) -> None:
    """The server's own messages (e.g. a generation that failed mid-stream) next to uvicorn's, in
    its format and at --log-level; they stop there (the library's plain stderr lines are for the
    rest of specdecode's messages, which --log-level leaves as they are)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger = logging.getLogger("specdecode.server")
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def _check(args: argparse.Namespace) -> None:
    for flag, value, low in (("--max-concurrency", args.max_concurrency, 1), ("--max-queue", args.max_queue, 0),
                             ("--max-body-bytes", args.max_body_bytes, 1024)):
        if value < low:
            raise InvalidConfigError(f"{flag} must be >= {low}, got {value}")
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not 0 < value <= 3600:
            raise InvalidConfigError(f"{flag} must be in (0, 3600] seconds, got {value}")
    parse_k_by_load(args.k_by_load)  # a bad table fails before any model loads
    if args.max_connections < 8:
        raise InvalidConfigError(f"--max-connections must be >= 8, got {args.max_connections}")
    if args.max_connections_per_client < 0:
        raise InvalidConfigError(f"--max-connections-per-client must be >= 0, got {args.max_connections_per_client}")
    if not 0 <= args.shutdown_timeout <= 3600:
        raise InvalidConfigError(f"--shutdown-timeout must be in [0, 3600] seconds, got {args.shutdown_timeout}")
    if not 0 <= args.port <= 65535:
        raise InvalidConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise InvalidConfigError("--api-key is empty; give a key or leave the option out")
    if args.api_key is not None and not (args.api_key.isascii() and args.api_key.isprintable()
                                         and args.api_key == args.api_key.strip()):
        raise InvalidConfigError("--api-key must be printable ASCII without surrounding spaces: HTTP clients "
                                 "cannot send other characters in a header, so no request could match it")
    if args.prefix_cache_file is not None and not args.prefix_cache:
        raise InvalidConfigError("--prefix-cache-file keeps the prefix cache's prompts; drop --no-prefix-cache")
    if args.metrics_public and args.api_key is None:
        raise InvalidConfigError("--metrics-public applies with --api-key (without a key /metrics is open anyway)")


def _listen(host: str, port: int) -> socket.socket:
    """Bind now, so a busy port is a one-line error instead of a failure after loading."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidConfigError(f"--host {host!r} is not an address of this machine: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise InvalidConfigError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port") from None
    sock.set_inheritable(True)
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
