"""A bounded load test of a local OpenAI-compatible server.

``python -m specdecode.server.loadtest --url http://127.0.0.1:8000 --concurrency 1,4,16 --requests 32``

For each concurrency level it sends exactly ``--requests`` streaming requests from that many
client threads and reports throughput and p50/p99 latency and TTFT; then it stops by itself
(each request is bounded by ``--timeout`` and the whole run by ``--max-seconds``). It only
talks to loopback addresses: it is a tool to measure this machine's server, not a way to load
someone else's. Prompts are the first turns of the built-in benchmark workloads. Standard
library only, so it runs wherever specdecode installs.

A server whose drafters learn across requests (``suffix``, ``combined``: earlier answers are a
datastore) copies its own earlier answer when a prompt comes again, so a level that resends
prompts an earlier level sent measures that copying, not the method. The warm-up therefore
sends a prompt of its own, and a comparison of methods should run each level on a fresh server
(``scripts/loadtest_k_by_load.sh`` does); within a level, prompts repeat only past the
workloads' count (18 for code,chat).
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from specdecode.bench.endpoint import sse_data
from specdecode.bench.workloads import load_workloads, parse_workload_names
from specdecode.errors import InvalidConfigError, SpecDecodeError


@dataclass(slots=True)
class Sample:
    ok: bool
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    drafts: int = 0
    accepted_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class LevelReport:
    concurrency: int
    requests: int
    ok: int
    errors: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    mean_acceptance_length: float
    first_error: str


@dataclass(frozen=True, slots=True)
class Target:
    url: str  # full endpoint URL
    model: str
    api: str  # "chat" or "completions"
    headers: dict[str, str]
    timeout: float


# Not a workload prompt: the warm-up's answer must not be in a server's history when a measured
# request asks the same (see the module docstring).
WARMUP_PROMPT = "Say hello in one word."


def loopback_base(url: str) -> str:
    """``url`` without a trailing ``/v1``; refuses any host that is not this machine's loopback."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme != "http" or not parts.hostname:
        raise InvalidConfigError(f"--url must look like http://127.0.0.1:8000, got {url!r}")
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(parts.hostname, parts.port or 80)}
    except socket.gaierror as exc:
        raise InvalidConfigError(f"cannot resolve {parts.hostname!r}: {exc.strerror}") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise InvalidConfigError(f"--url must point at this machine (loopback), got {parts.hostname!r}")
    path = parts.path.rstrip("/").removesuffix("/v1")
    return urllib.parse.urlunsplit(("http", parts.netloc, path, "", ""))


def one_request(target: Target, prompt: str, max_tokens: int, temperature: float, ignore_eos: bool) -> Sample:
    """One streaming request; never raises (failures are samples with ``ok`` False)."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if target.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    request = urllib.request.Request(target.url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **target.headers})
    start = time.perf_counter()
    sample = Sample(ok=False, latency_s=0.0)
    try:
        with urllib.request.urlopen(request, timeout=target.timeout) as response:
            for data in sse_data(response, start + target.timeout):
                if data.strip() == "[DONE]":
                    sample.ok = True
                    break
                _absorb(sample, json.loads(data), start)
    except urllib.error.HTTPError as exc:
        sample.error = f"HTTP {exc.code}: {exc.read(200).decode('utf-8', 'replace')}"
    except (OSError, ValueError, http.client.HTTPException, SpecDecodeError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
    sample.latency_s = time.perf_counter() - start
    return sample


def _absorb(sample: Sample, chunk: dict[str, Any], start: float) -> None:
    if "error" in chunk:
        raise ValueError(f"server error event: {chunk['error'].get('message')}")
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
        if text and sample.ttft_s is None:
            sample.ttft_s = time.perf_counter() - start
    if chunk.get("usage"):
        sample.completion_tokens = chunk["usage"]["completion_tokens"]
    if chunk.get("spec_decode"):
        sample.drafts = chunk["spec_decode"]["drafts"]
        sample.accepted_tokens = chunk["spec_decode"]["accepted_tokens"]


def run_level(target: Target, prompts: Sequence[str], concurrency: int, requests: int, deadline: float,
              max_tokens: int, temperature: float, ignore_eos: bool) -> LevelReport:
    """``requests`` requests from ``concurrency`` threads; none starts after ``deadline``."""
    counter = iter(range(requests))
    lock = threading.Lock()
    samples: list[Sample] = []

    def worker() -> None:
        while time.perf_counter() < deadline:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            sample = one_request(target, prompts[i % len(prompts)], max_tokens, temperature, ignore_eos)
            with lock:
                samples.append(sample)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(worker)
    return summarize(concurrency, samples, time.perf_counter() - start)


def summarize(concurrency: int, samples: Sequence[Sample], wall_s: float) -> LevelReport:
    good = [s for s in samples if s.ok]
    latencies = sorted(s.latency_s for s in good)
    ttfts = sorted(s.ttft_s for s in good if s.ttft_s is not None)
    drafts = sum(s.drafts for s in good)
    errors = [s.error for s in samples if not s.ok]
    return LevelReport(
        concurrency=concurrency, requests=len(samples), ok=len(good), errors=len(errors), wall_s=wall_s,
        requests_per_s=len(good) / wall_s if wall_s > 0 else 0.0,
        output_tokens_per_s=sum(s.completion_tokens for s in good) / wall_s if wall_s > 0 else 0.0,
        latency_p50_s=percentile(latencies, 0.50), latency_p99_s=percentile(latencies, 0.99),
        ttft_p50_s=percentile(ttfts, 0.50), ttft_p99_s=percentile(ttfts, 0.99),
        mean_acceptance_length=1.0 + sum(s.accepted_tokens for s in good) / drafts if drafts else 1.0,
        first_error=errors[0] if errors else "",
    )


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0.0 for no values."""
    if not sorted_values:
        return 0.0
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def markdown(reports: Sequence[LevelReport]) -> str:
    lines = ["| clients | requests | ok | req/s | output tok/s | latency p50 | latency p99 | TTFT p50 | TTFT p99 "
             "| mean acceptance length |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in reports:
        lines.append(f"| {r.concurrency} | {r.requests} | {r.ok} | {r.requests_per_s:.2f} | "
                     f"{r.output_tokens_per_s:.1f} | {r.latency_p50_s:.2f} s | {r.latency_p99_s:.2f} s | "
                     f"{r.ttft_p50_s:.2f} s | {r.ttft_p99_s:.2f} s | {r.mean_acceptance_length:.2f} |")
    return "\n".join(lines)


def _served_model(base: str, headers: dict[str, str], timeout: float) -> str:
    request = urllib.request.Request(base + "/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise InvalidConfigError(f"cannot read {base}/v1/models ({exc}); is the server running?") from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specdecode.server.loadtest", description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="server base URL, loopback only (default: %(default)s)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts (default: %(default)s)")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="temperature (default: 0, greedy)")
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens every time (equal-length requests)")
    p.add_argument("--api", choices=("chat", "completions"), default="chat", help="endpoint (default: %(default)s)")
    p.add_argument("--workload", default="code,chat", help="built-in workloads for prompts (default: %(default)s)")
    p.add_argument("--model", default=None, help="model id to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer key if the server was started with --api-key")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before the first level (default: 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default: %(default)s)")
    p.add_argument("--max-seconds", type=float, default=3600.0,
                   help="no new request starts after this many seconds of the run (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
        if not levels or min(levels) < 1 or args.requests < 1 or args.max_tokens < 1:
            raise ValueError
    except ValueError:
        print("loadtest: error: --concurrency needs integers >= 1 (e.g. 1,4,16); --requests and "
              "--max-tokens >= 1", file=sys.stderr)
        return 2
    try:
        base = loopback_base(args.url)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.model or _served_model(base, headers, args.timeout)
        prompts = [p.turns[0] for p in load_workloads(parse_workload_names(args.workload))]
    except InvalidConfigError as exc:
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return 2
    path = "/v1/chat/completions" if args.api == "chat" else "/v1/completions"
    target = Target(base + path, model, args.api, headers, args.timeout)
    deadline = time.perf_counter() + args.max_seconds
    for _ in range(args.warmup):
        warm = one_request(target, WARMUP_PROMPT, args.max_tokens, args.temperature, args.ignore_eos)
        if not warm.ok:
            print(f"loadtest: error: warm-up request failed: {warm.error}", file=sys.stderr)
            return 1
    reports = []
    for level in levels:
        reports.append(run_level(target, prompts, level, args.requests, deadline, args.max_tokens,
                                 args.temperature, args.ignore_eos))
        print(f"loadtest: {level} clients done ({reports[-1].ok}/{reports[-1].requests} ok)",
              file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"url": target.url, "model": model, "max_tokens": args.max_tokens,
                          "levels": [asdict(r) for r in reports]}))
    else:
        print(markdown(reports))
    for r in reports:
        if r.first_error:
            print(f"loadtest: {r.errors} failed at {r.concurrency} clients, e.g. {r.first_error}", file=sys.stderr)
    return 0 if all(r.errors == 0 and r.ok == args.requests for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
