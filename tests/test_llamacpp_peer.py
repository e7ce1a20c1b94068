"""``bench --peers llamacpp`` against a stub ``llama-server``; the real one runs in tests_peers/.

The stub is an executable script speaking the part of llama-server's protocol the peer uses:
``--version``, ``GET /health`` and streamed ``POST /v1/completions`` with token-id prompts and
``__verbose.tokens``. It answers with specdecode's own greedy decoding of the GGUF it is given
(so a faithful peer agrees with ours token for token), and can be told to change one token
(``STUB_DIVERGE_AT``) or to die while starting (``STUB_FAIL``).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from specdecode.bench import llamacpp_build
from specdecode.bench.llamacpp import REQUEST_EXTRA, peer_gguf
from specdecode.bench.peers import PeerUnavailableError
from specdecode.cli import main
from tests.gguf_blocks import write_model_gguf
from tests.test_bench import bench

STUB = r'''
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
if "--version" in args:
    print("version: 0.0.0-stub (build 1, commit stub)", file=sys.stderr)
    sys.exit(0)
if os.environ.get("STUB_FAIL"):
    print("error: stub told to fail", file=sys.stderr)
    sys.exit(3)
model, port = args[args.index("-m") + 1], int(args[args.index("--port") + 1])

from specdecode.api import LLM
from specdecode.params import SamplingParams

llm = LLM(model=model, max_seq_len=512, progress=False)
diverge_at = int(os.environ.get("STUB_DIVERGE_AT", "-1"))
log = os.environ.get("STUB_LOG")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status":"ok"}')

    def do_POST(self):
        if self.path != "/v1/completions":
            self.send_response(404)
            self.end_headers()
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"argv": args, "body": body}) + "\n")
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=0.0)
        out = llm.engine.generate(body["prompt"], params)
        tokens = list(out.token_ids)
        if 0 <= diverge_at < len(tokens):
            tokens[diverge_at] = (tokens[diverge_at] + 1) % 64
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for t in tokens:
            chunk = {"choices": [{"text": llm.tokenizer.decode([t]) or "?", "finish_reason": None}],
                     "__verbose": {"tokens": [t]}}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        final = {"choices": [{"text": "", "finish_reason": out.finish_reason}], "__verbose": {"tokens": []},
                 "usage": {"completion_tokens": len(tokens), "prompt_tokens": len(body["prompt"])}}
        self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("llamacpp-pair")
    write_model_gguf(root / "target.gguf", {"": "Q8_0"}, seed=5)
    write_model_gguf(root / "draft.gguf", {"": "Q4_0"}, seed=5)
    return root / "target.gguf", root / "draft.gguf"


@pytest.fixture(scope="module")
def stub_server(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stub") / "llama-server"
    repo = Path(__file__).resolve().parents[1]
    path.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(repo)!r})\n{STUB}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _peer_bench(tmp_path: Path, gguf_pair, server: Path, *extra: str) -> tuple[int, dict, list[dict]]:
    target, draft = gguf_pair
    return bench(tmp_path, "--model", str(target), "--draft", str(draft), "--methods", "none,draft_model",
                 "--workload", "code", "--limit", "1", "--max-tokens", "12", "--max-seq-len", "512",
                 "--peers", "llamacpp", "--llamacpp-server", str(server), *extra)


def test_llamacpp_peer_runs_both_modes_on_the_same_gguf(gguf_pair, stub_server, tmp_path, monkeypatch):
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("STUB_LOG", str(log))
    code, summary, rows = _peer_bench(tmp_path, gguf_pair, stub_server, "--llamacpp-args", "--spec-draft-n-max 8")
    assert code == 0
    peers = summary["peers"]
    assert set(peers) == {"llamacpp_target", "llamacpp_draft"}
    for name, peer in peers.items():
        assert peer["tokens_per_s"] > 0 and peer["ttft_s"] > 0 and peer["tpot_s"] > 0, name
        assert peer["identical_to_ours"] is True and peer["agreement"] == 1.0, name
        assert peer["agreed_tokens"] == peer["compared_tokens"] > 0 and peer["first_divergences"] == []
        assert "0.0.0-stub" in peer["settings"]["library"]
    for m in summary["methods"].values():
        assert m["speedup_vs_llamacpp"] > 0
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    target, draft = gguf_pair
    for req in requests:  # our chat template's token ids, llama.cpp's fields, the same GGUF files
        assert all(isinstance(t, int) for t in req["body"]["prompt"]) and req["body"]["temperature"] == 0.0
        assert {k: req["body"][k] for k in REQUEST_EXTRA} == REQUEST_EXTRA
        assert req["body"]["cache_prompt"] is True  # its prompt cache on, as our prefix cache is by default
        argv = req["argv"]
        assert argv[argv.index("-m") + 1] == str(target.resolve()) and argv[-6:-4] == ["--spec-draft-n-max", "8"]
    drafting = [r["argv"] for r in requests if "-md" in r["argv"]]
    assert drafting and all(a[a.index("-md") + 1] == str(draft.resolve()) for a in drafting)
    report = (tmp_path / "out" / "summary.md").read_text()
    assert "vs llama.cpp" in report and "Speedup vs llamacpp_target per category" in report
    assert (tmp_path / "out" / "llamacpp_target.log").is_file()


def test_llamacpp_peer_reports_where_its_tokens_part_from_ours(gguf_pair, stub_server, tmp_path, monkeypatch,
                                                               capsys):
    monkeypatch.setenv("STUB_DIVERGE_AT", "3")
    code, summary, _ = _peer_bench(tmp_path, gguf_pair, stub_server)
    assert code == 0  # a peer's drift is reported, not an identity failure of ours
    peer = summary["peers"]["llamacpp_target"]
    assert peer["identical_to_ours"] is False and peer["first_divergences"] == [3]
    assert peer["agreed_tokens"] == 3 and 0 < peer["agreement"] < 1
    assert "note: peer llamacpp_target differs" in capsys.readouterr().err


def test_a_llamacpp_server_that_dies_is_a_named_error(gguf_pair, stub_server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STUB_FAIL", "1")
    code, _, _ = _peer_bench(tmp_path, gguf_pair, stub_server)
    err = capsys.readouterr().err
    assert code != 0 and "llama-server exited with status 3" in err and "stub told to fail" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--peers", "sglang"], "unknown peer 'sglang'"),
    (["--peers", ","], "--peers is empty"),
    (["--llamacpp-args", "-t 4"], "apply to --peers llamacpp"),
    (["--peers", "llamacpp", "--llamacpp-args", "'unclosed"], "--llamacpp-args"),
    (["--peers", "llamacpp", "--llamacpp-server", "/no/such/llama-server"], "not an executable file"),
])
def test_bad_peer_options_are_refused_before_loading(tmp_path, capsys, args, message):
    code = main(["bench", "--no-progress", "--out", str(tmp_path / "o"), "--workload", "code", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_catalog_parts_are_joined_once_into_one_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_HOME", str(tmp_path / "home"))
    whole = os.urandom(3000)
    parts = [tmp_path / "part01.bin", tmp_path / "part02.bin"]
    parts[0].write_bytes(whole[:1000])
    parts[1].write_bytes(whole[1000:])
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "specdecode_conversion.json").write_text(json.dumps({"sources": [str(p) for p in parts]}))
    joined = peer_gguf(folder, progress=False)
    assert joined.read_bytes() == whole and joined.parent == tmp_path / "home" / "peers" / "gguf"
    mtime = joined.stat().st_mtime_ns
    assert peer_gguf(folder, progress=False) == joined and joined.stat().st_mtime_ns == mtime  # reused
    single = tmp_path / "one"
    single.mkdir()
    (single / "specdecode_conversion.json").write_text(json.dumps({"sources": [str(parts[0])]}))
    assert peer_gguf(single, progress=False) == parts[0]  # one file: used where it is


def test_an_hf_folder_has_no_gguf_for_llamacpp(tiny_models):
    with pytest.raises(PeerUnavailableError, match="GGUF"):
        peer_gguf(tiny_models["llama"], progress=False)


def test_building_without_cmake_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(PeerUnavailableError, match="cmake"):
        llamacpp_build.find_llama_server(None)
    with pytest.raises(PeerUnavailableError, match="no llama-server"):
        llamacpp_build.find_llama_server(None, build=False)
