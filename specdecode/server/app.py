"""The FastAPI application: OpenAI's endpoints over one loaded model and its scheduler.

Bodies are read and parsed here rather than by FastAPI's parameter injection, so that every
problem (too large, not JSON, wrong field) gets OpenAI's error shape and a 4xx, and nothing a
client sends can produce a 500. Generation itself happens in the scheduler; this layer only
validates, submits, and streams or collects the job's events (a job per sample when ``n`` > 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from specdecode.api import LLM
from specdecode.engine.openmp import release_pool
from specdecode.errors import DamagedCacheError, InvalidConstraintError, SpecDecodeError
from specdecode.models.watch import WATCH
from specdecode.params import Constraint
from specdecode.server.connections import DEFAULT_BODY_TIMEOUT_S
from specdecode.server.http_errors import APIError, bad_request, from_spec_error, from_validation_error
from specdecode.server.metrics import CONTENT_TYPE, ServerMetrics
from specdecode.server.protocol import (
    ChunkWriter,
    Prepared,
    chat_body,
    completion_body,
    constraint_param,
    prepare_chat,
    prepare_completion,
)
from specdecode.server.scheduler import JobQueue
from specdecode.server.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from specdecode.server.streaming import EventStreamResponse, TrackedJob, collect, merged

log = logging.getLogger("specdecode.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any prompt that fits a 32k-token context
_DRAIN_CAP_BYTES = 64 << 20  # read (and drop) at most this much of an oversized body
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/metrics", "/health")
CLIENT_CLOSED = 499  # nginx's code for "the client went away before the answer"


def _check_constraint(llm: LLM, constraint: Constraint) -> None:
    """``GrammarCompiler.check`` on an executor thread, which then gives back the OpenMP workers its
    vocabulary-wide masks may have started (engine/openmp.py: a second pool slows every step)."""
    try:
        llm.engine.grammars.check(constraint)
    finally:
        release_pool()


def create_app(llm: LLM, scheduler: JobQueue, api_key: str | None = None, *,
               served_model_name: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               cors_origins: Sequence[str] = (), allowed_hosts: Sequence[str] = (),
               metrics_public: bool = False, body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
               on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """An app serving ``llm`` through ``scheduler``. With ``api_key``, every request needs
    ``Authorization: Bearer <api_key>`` before anything else is looked at (so an unknown caller
    learns no routes), except ``/health`` for probes and, with ``metrics_public``, ``/metrics``.

    A request body must arrive within ``body_timeout`` seconds of its headers (else 408), so a
    client that stops sending cannot hold a request open.

    A web page the user visits cannot drive the server: POST bodies must be declared
    ``application/json``, which a page can send cross-origin only after a CORS preflight, and
    CORS is off unless ``cors_origins`` names the pages allowed (none by default). Nor can it
    read answers through DNS rebinding (its own host name resolved to this server): requests
    must name the server by an IP address, ``localhost`` or one of ``allowed_hosts`` ("*": any).

    ``on_shutdown`` runs when the server shuts down (its lifespan's end, after the connections
    closed), e.g. to save the prefix cache: uvicorn ends the process on the signal it stopped for
    right after, so code after ``server.run`` may never run.
    """
    served = served_model_name or llm.model_name
    names = {served, llm.model_name}
    method = scheduler.method or llm.spec.method
    k = scheduler.k or llm.spec.num_speculative_tokens
    metrics = ServerMetrics(scheduler, served, method, k, llm.engine.caches)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="specdecode", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False})
    app.state.metrics = metrics
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    if api_key is not None:
        open_paths = {"/health", "/metrics"} if metrics_public else {"/health"}
        app.add_middleware(_RequireKey, key=api_key, open_paths=open_paths)
    app.add_middleware(_CheckHost, allowed=allowed_hosts)
    app.add_middleware(_CountRequests, metrics=metrics)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)

    def check_model(name: str) -> None:
        if name not in names:
            shown = name if len(name) <= 100 else name[:100] + "..."
            raise APIError(404, f"The model `{shown}` does not exist; this server serves `{served}`",
                           param="model", code="model_not_found")

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        return ModelList(data=[ModelCard(id=served, created=created)]).model_dump(mode="json")

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return ModelCard(id=served, created=created).model_dump(mode="json")

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        req = _parse(CompletionRequest, await _read_json(request, max_body_bytes, body_timeout))
        return await generate(request, req, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = _parse(ChatCompletionRequest, await _read_json(request, max_body_bytes, body_timeout))
        return await generate(request, req, chat=True)

    async def generate(request: Request, req: CompletionRequest | ChatCompletionRequest, chat: bool) -> Response:
        check_model(req.model)
        problem = req.unsupported()
        if problem is not None:
            raise bad_request(problem[1], problem[0], "unsupported_parameter")
        try:  # e.g. a model without a chat template, or a prompt the engine refuses
            prepared = prepare_chat(req, llm) if chat else prepare_completion(req, llm)
            _check_samples(prepared, scheduler.max_samples)
            if prepared.params.constraint is not None:  # compile it now: a bad schema is a 400, not a failed stream
                await asyncio.to_thread(_check_constraint, llm, prepared.params.constraint)
            jobs = scheduler.submit_samples(prepared.prompt_ids, prepared.samples())
        except InvalidConstraintError as exc:
            raise bad_request(str(exc), constraint_param(req), "invalid_value") from None
        except SpecDecodeError as exc:
            raise from_spec_error(exc) from None
        tracked = [TrackedJob(job, metrics) for job in jobs]
        if req.stream:  # never ranked (best_of > 1 is refused with stream)
            writer = ChunkWriter(chat, served, req.include_usage, llm.tokenizer, prepared.n)
            return EventStreamResponse(_sse(tracked, writer))
        try:
            outputs = await collect(tracked, request.receive)
        except SpecDecodeError as exc:
            raise from_spec_error(exc) from None
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        body = (chat_body if chat else completion_body)(served, prepared.choices(outputs), outputs, llm.tokenizer)
        return JSONResponse(body)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if not scheduler.alive:  # closed, or its worker thread died
            return JSONResponse({"status": "unavailable"}, status_code=503)
        try:
            WATCH.check()
        except DamagedCacheError as exc:  # weights being rebuilt: a balancer should route elsewhere
            return JSONResponse({"status": "repairing", "message": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _check_samples(prepared: Prepared, limit: int | None) -> None:
    """Refuse more samples of one prompt than the scheduler runs at once (a slot each)."""
    if limit is not None and prepared.best_of > limit:
        param = "best_of" if prepared.ranked else "n"
        raise bad_request(f"{param} is {prepared.best_of} but this server runs at most {limit} sequences at once "
                          f"(--max-concurrency {limit}); lower {param}", param, "invalid_value")


async def _sse(tracked: list[TrackedJob], writer: ChunkWriter) -> AsyncIterator[str]:
    """The stream's events (every choice's, as they come); an error after the headers went out
    becomes an error event."""
    for event in writer.start():
        yield event
    try:
        async with contextlib.aclosing(merged(tracked)) as events:
            async for index, event in events:
                if event.text or event.logprobs:
                    yield writer.text(event.text, event.logprobs, index)
                if event.output is not None:
                    yield writer.finish(event.output, index)
        for chunk in writer.close([job.output for job in tracked if job.output is not None]):
            yield chunk
        return
    except SpecDecodeError as exc:
        err = from_spec_error(exc)
    except APIError as exc:
        err = exc
    except Exception:
        log.exception("generation failed mid-stream")
        err = APIError(500, "internal error during generation", type="server_error")
    for chunk in writer.error(err):
        yield chunk


async def _read_json(request: Request, limit: int, timeout: float = DEFAULT_BODY_TIMEOUT_S) -> dict[str, Any]:
    """The body as a JSON object declared ``application/json``, at most ``limit`` bytes; anything
    else is a 4xx. (A form or text/plain POST is what a web page may send without a preflight.)"""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        await _drain(request.receive)
        raise APIError(415, f"the request body must be sent as Content-Type: application/json, not "
                            f"{media_type[:80] or 'none'}", code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        await _drain(request.receive)
        raise _too_large(limit)
    body = bytearray()
    deadline = time.monotonic() + timeout
    while True:
        try:
            message = await asyncio.wait_for(request.receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                           code="request_timeout", headers={"Connection": "close"}) from None
        if message["type"] != "http.request":  # the client left before sending it all
            raise bad_request("the request body ended early")
        body += message.get("body", b"")
        if len(body) > limit:
            await _drain(request.receive)
            raise _too_large(limit)
        if not message.get("more_body", False):
            break
    if not body.strip():
        raise bad_request("the request body is empty: send a JSON object")
    try:
        data = json.loads(body, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    try:  # JSON may escape lone UTF-16 surrogates ("\ud800"), which no tokenizer can take
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("the request body contains a lone UTF-16 surrogate (an invalid \\uXXXX escape)",
                          code="invalid_json") from None
    return data


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def _drain(receive: Receive) -> None:
    """Read the rest of an oversized body so the client sees our 413 rather than a reset."""
    seen = 0
    while seen < _DRAIN_CAP_BYTES:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        seen += len(message.get("body", b""))


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def _parse(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no endpoint {request.method} {request.url.path}; the API lives under /v1"
    else:
        message = f"{request.method} {request.url.path}: {exc.detail}"
    return APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None,
                    headers=dict(exc.headers or {})).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s %s: %s (traceback follows from the server)", request.method,
              request.url.path, _excerpt(repr(exc)))
    return APIError(500, "internal server error", type="server_error").response()


def _excerpt(text: str, most: int = 500) -> str:
    """At most ``most`` characters of ``text``: a log line never carries a user's whole prompt or grammar."""
    return text if len(text) <= most else f"{text[:most]} ... ({len(text)} characters)"


class _RequireKey:
    """ASGI middleware: ``Authorization: Bearer <key>`` on every path but ``open_paths``, checked
    before routing, so a caller without the key gets 401 for real and unknown paths alike."""

    def __init__(self, app: ASGIApp, key: str, open_paths: set[str]) -> None:
        self.app, self.key, self.open_paths = app, key.encode(), open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)  # OPTIONS: CORS preflights carry no credentials
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key")
        await error.response()(scope, receive, send)


class _CheckHost:
    """ASGI middleware: refuse a Host header that names this server by a name it was not given.

    DNS rebinding points a page's own host name at this server, so the browser treats the answers
    as the page's; such requests carry that name. IP addresses and ``localhost`` cannot be
    rebound, so they always pass; any other name must be listed (``--allowed-hosts``).
    """

    def __init__(self, app: ASGIApp, allowed: Sequence[str]) -> None:
        self.app = app
        self.any = "*" in allowed
        self.allowed = {h.lower().rstrip(".") for h in allowed} | {"localhost"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.any or self.host_ok(scope):
            await self.app(scope, receive, send)
            return
        error = APIError(403, "this server does not answer to the host name in the Host header; if it is "
                              "yours, start it with --allowed-hosts NAME", code="host_not_allowed")
        await error.response()(scope, receive, send)

    def host_ok(self, scope: Scope) -> bool:
        raw = dict(scope.get("headers") or []).get(b"host")
        if raw is None:  # HTTP/1.0 without Host: nothing a browser sends
            return True
        name = _host_name(raw.decode("latin-1").strip().lower()).rstrip(".")
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return name in self.allowed


def _host_name(host: str) -> str:
    """The name in a Host header: ``a.b:80`` -> ``a.b``, ``[::1]:80`` -> ``::1``."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.partition(":")[0] if host.count(":") == 1 else host


class _CountRequests:
    """ASGI middleware: count every response by endpoint and status (500 if none was sent)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def record(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            path = scope.get("path", "")
            self.metrics.request(path if path in ENDPOINTS else "other", status)
