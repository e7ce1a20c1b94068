"""Benchmark any OpenAI-compatible server (ours, vLLM, llama.cpp's server) over HTTP.

Uses only the standard library (urllib and a small Server-Sent Events parser), so it runs wherever
specdecode installs. Each request streams (``"stream": true``); TTFT is the time to the first
non-empty text piece, TPOT the rest of the time over the remaining tokens. Token counts come from
the server's ``usage`` (requested with ``stream_options.include_usage``) when it reports one, else
from the number of streamed text pieces (servers usually send one token per piece, but a
speculative server may send several: then only ``usage`` is exact). Every network wait is bounded:
the socket by ``timeout`` and the whole request by a deadline of the same length.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from specdecode.bench.runner import Contestant
from specdecode.params import SamplingParams
from specdecode.engine.generation import GenerationOutput
from specdecode.errors import InvalidConfigError, SpecDecodeError
from specdecode.engine.stats import RequestStats

APIS = ("chat", "completions")


class EndpointError(SpecDecodeError):
    """The server could not be reached, answered with an error, or timed out."""


@dataclass(slots=True)
class StreamResult:
    text: str
    completion_tokens: int
    prompt_tokens: int | None
    ttft_s: float | None
    total_s: float
    finish_reason: str
    token_count_source: str  # "usage" (reported by the server) or "chunks" (counted here)
    token_ids: list[int] = field(default_factory=list)  # only from servers that report them (llama.cpp, vLLM)


def endpoint_url(base: str, api: str) -> str:
    """``http://host:8000`` or ``.../v1`` -> ``.../v1/chat/completions`` (a full path is kept)."""
    parts = urllib.parse.urlsplit(base.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidConfigError(f"--endpoint must be an http(s) URL like http://127.0.0.1:8000, got {base!r}")
    if api not in APIS:
        raise InvalidConfigError(f"--endpoint-api must be one of {', '.join(APIS)}, got {api!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/completions"):
        if not path.endswith("/v1"):
            path += "/v1"
        path += "/chat/completions" if api == "chat" else "/completions"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def render_for(api: str):
    """How a conversation becomes a request body field: chat messages as they are; for the
    completions API the turns and answers joined by blank lines (no template is known here)."""
    if api == "chat":
        return lambda messages: [dict(m) for m in messages]
    return lambda messages: "\n\n".join(m["content"] for m in messages)


def endpoint_contestant(url: str, model: str, api: str, timeout: float,
                        notes: dict[str, Any] | None = None, *, extra: dict[str, Any] | None = None,
                        name: str = "endpoint", method: str = "endpoint", kind: str = "endpoint") -> Contestant:
    """A contestant that sends each request to ``url``; ``notes`` records how tokens were counted.

    ``extra`` adds server-specific fields to every request body (the llama.cpp peer asks for its
    token ids with them); ``name``, ``method`` and ``kind`` label its rows.
    """

    def generate(prompt: Any, params: SamplingParams) -> GenerationOutput:
        payload: dict[str, Any] = {"model": model, "max_tokens": params.max_tokens,
                                   "temperature": params.temperature, "stream": True,
                                   "stream_options": {"include_usage": True}, **(extra or {})}
        payload["messages" if api == "chat" else "prompt"] = prompt
        if params.top_p < 1.0:
            payload["top_p"] = params.top_p
        if params.seed is not None:
            payload["seed"] = params.seed
        res = stream_completion(url, payload, timeout, api)
        if notes is not None:
            notes.setdefault("token_count_source", res.token_count_source)
        stats = RequestStats(prompt_tokens=res.prompt_tokens or 0, completion_tokens=res.completion_tokens,
                             ttft_s=res.ttft_s or 0.0, total_s=res.total_s)
        return GenerationOutput(text=res.text, token_ids=res.token_ids, finish_reason=res.finish_reason,
                                prompt_token_ids=prompt if _is_token_ids(prompt) else [], method=method, stats=stats)

    return Contestant(name, method, None, kind, generate)


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)


def stream_completion(url: str, payload: dict[str, Any], timeout: float, api: str = "chat") -> StreamResult:
    """POST ``payload`` and consume the SSE stream until ``[DONE]`` or the end of the body."""
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode("utf-8"), method="POST",
        headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
    )
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return _consume(sse_data(response, start + timeout), start, api)
    except urllib.error.HTTPError as exc:
        body = exc.read(300).decode("utf-8", "replace").strip().replace("\n", " ")
        raise EndpointError(f"{url} answered HTTP {exc.code}: {body or exc.reason}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, (TimeoutError, socket.timeout)):
            raise EndpointError(f"{url} did not answer within {timeout:g} s (raise --timeout)") from None
        raise EndpointError(f"cannot reach {url}: {exc.reason}; is the server running?") from None
    except (TimeoutError, socket.timeout):
        raise EndpointError(f"{url} did not answer within {timeout:g} s (raise --timeout)") from None
    except (ConnectionError, http.client.HTTPException) as exc:  # e.g. the server died mid-stream
        raise EndpointError(f"connection to {url} failed: {exc!r}") from None


def sse_data(lines: Iterable[bytes], deadline: float) -> Iterator[str]:
    """The ``data`` of each Server-Sent Event (multi-line data joined with newlines)."""
    data: list[str] = []
    for raw in lines:
        if time.perf_counter() > deadline:
            raise TimeoutError("stream deadline passed")
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):  # comment or keep-alive
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _consume(events: Iterator[str], start: float, api: str) -> StreamResult:
    pieces: list[str] = []
    chunks = 0
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    finish = ""
    token_ids: list[int] = []
    done = False
    for data in events:
        if data.strip() == "[DONE]":
            done = True
            break
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise EndpointError(f"the server sent a stream event that is not JSON: {data[:120]!r}") from None
        if "error" in chunk:
            raise EndpointError(f"the server reported an error: {json.dumps(chunk['error'])[:300]}")
        usage = chunk.get("usage") or usage
        token_ids += (chunk.get("__verbose") or {}).get("tokens") or []  # llama.cpp's, when asked for
        for choice in chunk.get("choices") or []:
            token_ids += choice.get("token_ids") or []  # vLLM's, with return_token_ids
            text = (choice.get("delta") or {}).get("content") if api == "chat" else choice.get("text")
            if text:
                if ttft is None:
                    ttft = time.perf_counter() - start
                pieces.append(text)
                chunks += 1
            finish = choice.get("finish_reason") or finish
    if not done and not finish:  # the body ended mid-answer: the server closed it (or died)
        raise EndpointError(f"the stream ended after {chunks} piece(s) with neither a finish_reason nor [DONE]; "
                            "the server closed the connection mid-answer")
    total = time.perf_counter() - start
    counted = usage is not None and isinstance(usage.get("completion_tokens"), int)
    return StreamResult(
        text="".join(pieces), completion_tokens=usage["completion_tokens"] if counted else chunks,
        prompt_tokens=(usage or {}).get("prompt_tokens"), ttft_s=ttft, total_s=total,
        finish_reason=finish or "length", token_count_source="usage" if counted else "chunks",
        token_ids=token_ids,
    )
