"""``specdecode serve`` as a process, and the bounded load-test script."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import openai
import pytest
from server_support import LiveServer, metric, read_until, wait_until

from specdecode import LLM
from specdecode.bench.workloads import load_workloads, parse_workload_names
from specdecode.server import loadtest
from specdecode.server.app import create_app
from specdecode.server.scheduler import Scheduler
from tests.test_cli import run_cli


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Flag checks that end before a server starts run in this process (``run_cli``); the rest start
# real servers, where signals and exits matter.
def test_serve_help_lists_the_issue_flags():
    res = run_cli("serve", "--help")
    assert res.returncode == 0
    for flag in ("--model", "--draft", "--method", "-k", "--host", "--port", "--api-key", "--max-concurrency",
                 "--max-queue", "--max-seq-len", "--draft-quantize", "--served-model-name", "--allowed-hosts",
                 "--metrics-public"):
        assert flag in res.stdout


def test_serve_busy_port_is_one_line_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = run_cli("serve", "--model", "unused", "--port", str(taken.getsockname()[1]))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "cannot listen" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--api-key", "clé"], "printable ASCII"),
    (["--api-key", "k ey\t"], "printable ASCII"),
    (["--metrics-public"], "applies with --api-key"),
])
def test_serve_refuses_keys_no_client_can_send(args, message):
    res = run_cli("serve", "--model", "unused", *args)
    assert res.returncode == 2 and message in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_serve_end_to_end(tiny_pair):
    target, draft = tiny_pair
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdecode.cli", "serve", "--model", str(target), "--draft", str(draft),
         "--method", "ngram", "-k", "3", "--port", str(port), "--served-model-name", "tiny",
         "--api-key", "k3y", "--max-seq-len", "256", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k3y", max_retries=0, timeout=30)

        def up() -> bool:
            try:
                return client.models.list().data[0].id == "tiny"
            except openai.APIConnectionError:
                assert proc.poll() is None, proc.communicate()[1]
                return False

        assert wait_until(up, timeout=120)
        resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ab ab ab"}],
                                              max_tokens=12, temperature=0)
        assert resp.model_extra["spec_decode"]["method"] == "ngram"
        assert resp.usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError, match="at most"):
            client.completions.create(model="tiny", prompt="a", max_tokens=300)  # --max-seq-len 256
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert f"on http://127.0.0.1:{port}/v1" in stderr
    assert "Traceback" not in stderr


@pytest.fixture(scope="module")
def tiny_server(tiny_pair):
    target, draft = tiny_pair
    llm = LLM(model=str(target), draft=str(draft), method="draft_model", num_speculative_tokens=3,
              max_seq_len=512, progress=False)
    scheduler = Scheduler(llm, max_concurrency=2, max_queue=8)
    with LiveServer(create_app(llm, scheduler, served_model_name="tiny")) as server:
        yield server
    scheduler.close()


def test_loadtest_runs_bounded_and_reports(tiny_server, capsys):
    start = time.monotonic()
    code = loadtest.main(["--url", tiny_server.url + "/v1", "--concurrency", "1,3", "--requests", "5",
                          "--max-tokens", "6", "--workload", "code", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and time.monotonic() - start < 60
    assert out["model"] == "tiny" and [lv["concurrency"] for lv in out["levels"]] == [1, 3]
    for level in out["levels"]:
        assert level["ok"] == level["requests"] == 5 and level["errors"] == 0
        assert 0 < level["latency_p50_s"] <= level["latency_p99_s"]
        assert 0 < level["ttft_p50_s"] <= level["ttft_p99_s"]
        assert level["output_tokens_per_s"] > 0 and level["mean_acceptance_length"] >= 1.0
    # 1 warm-up + 2 levels x 5 requests, all counted by the server
    assert metric(tiny_server.metrics(), "specdecode_requests_total", endpoint="/v1/chat/completions",
                  status="200") == 11


def test_loadtest_warm_up_sends_no_measured_prompt(monkeypatch, capsys):
    """A server that learns from its earlier answers must not have seen a measured prompt when it
    is measured: the warm-up asks a prompt of its own, and each level's requests are the
    workload's prompts in order."""
    sent: list[str] = []

    def fake_request(target, prompt, max_tokens, temperature, ignore_eos):
        sent.append(prompt)
        return loadtest.Sample(ok=True, latency_s=0.01, ttft_s=0.005, completion_tokens=max_tokens)

    monkeypatch.setattr(loadtest, "one_request", fake_request)
    code = loadtest.main(["--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "1", "--requests", "3",
                          "--warmup", "2", "--workload", "code", "--json"])
    assert code == 0
    prompts = [p.turns[0] for p in load_workloads(parse_workload_names("code"))]
    assert sent[:2] == [loadtest.WARMUP_PROMPT] * 2 and loadtest.WARMUP_PROMPT not in prompts
    assert sent[2:] == prompts[:3]


def test_loadtest_table_and_refusals(tiny_server, capsys):
    assert loadtest.main(["--url", tiny_server.url, "--concurrency", "2", "--requests", "2", "--max-tokens", "3",
                          "--api", "completions", "--warmup", "0"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| clients |") and "\n| 2 | 2 | 2 |" in table
    assert loadtest.main(["--url", "http://192.0.2.1:8000", "--requests", "1"]) == 2  # not loopback
    assert "loopback" in capsys.readouterr().err
    assert loadtest.main(["--url", tiny_server.url, "--concurrency", "0"]) == 2
    # a wrong model name: every request fails, reported, exit 1, and still bounded
    assert loadtest.main(["--url", tiny_server.url, "--model", "nope", "--requests", "2", "--concurrency", "1",
                          "--warmup", "0"]) == 1
    assert "HTTP 404" in capsys.readouterr().err


def test_percentile():
    assert loadtest.percentile([], 0.5) == 0.0
    assert loadtest.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert loadtest.percentile([1.0, 2.0, 3.0, 4.0], 0.99) == pytest.approx(3.97)
    assert loadtest.percentile([5.0], 0.99) == 5.0


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory):
    """A small random model slow enough (some ms a token) that a long request outlives a grace."""
    from conftest import make_tiny_llm

    return make_tiny_llm(tmp_path_factory.mktemp("slow") / "model", "qwen2", seed=3, hidden_size=512,
                         intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)


def _start_serve(target, port: int, *extra: str, files: int | None = None) -> subprocess.Popen:
    """``specdecode serve`` in a subprocess, up; ``files``: its open-file limit (``ulimit -n``)."""
    def limit_files() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    proc = subprocess.Popen(
        [sys.executable, "-m", "specdecode.cli", "serve", "--model", str(target), "--port", str(port),
         "--served-model-name", "tiny", "--max-seq-len", "4096", "--log-level", "warning", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limit_files if files else None)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)

    def up() -> bool:
        try:
            return bool(client.models.list().data)
        except openai.APIConnectionError:
            assert proc.poll() is None, proc.communicate()[1]
            return False

    assert wait_until(up, timeout=120)
    return proc


def _long_requests(port: int, max_tokens: int) -> tuple[dict, list]:
    """Start a non-streaming and a streaming request in threads; return their result holders."""
    import threading
    import urllib.request

    body = {"model": "tiny", "prompt": "a b", "max_tokens": max_tokens, "ignore_eos": True}
    results: dict = {}

    def send(stream: bool) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps({**body, "stream": stream}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=900) as resp:  # a slow or busy machine takes its time
                results[stream] = (resp.status, resp.headers.get("content-type"), resp.read().decode())
        except urllib.error.HTTPError as exc:
            results[stream] = (exc.code, exc.headers.get("content-type"), exc.read().decode())

    threads = [threading.Thread(target=send, args=(s,)) for s in (False, True)]
    for t in threads:
        t.start()
    return results, threads


def test_sigterm_ends_unfinished_requests_with_the_documented_errors(slow_model):
    import signal

    port = free_port()
    proc = _start_serve(slow_model, port, "--shutdown-timeout", "0.5")
    results, threads = _long_requests(port, 3000)
    time.sleep(1.0)  # both are generating
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=60)
    _, stderr = proc.communicate(timeout=60)
    status, ctype, text = results[False]
    assert status == 503 and ctype.startswith("application/json")
    assert json.loads(text)["error"]["code"] == "generation_aborted"
    status, _, text = results[True]
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "generation_aborted"
    assert "ending 2 request(s)" in stderr and "Traceback" not in stderr
    assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down


def test_sigterm_lets_running_requests_finish_within_the_grace(slow_model):
    """Bound by what it checks, not by this machine's speed: the grace (15 minutes) outlasts the
    two requests however slow or busy the machine, and 300 tokens (about 9 s on a 2-core EPYC)
    outlast the second before the signal however fast."""
    import signal

    port = free_port()
    proc = _start_serve(slow_model, port, "--shutdown-timeout", "900")
    results, threads = _long_requests(port, 300)
    time.sleep(0.5)
    assert not results  # both still generating
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(ConnectionError):  # no new connection is accepted during the grace
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert not results
    for t in threads:
        t.join(timeout=900)
    proc.communicate(timeout=900)
    status, _, text = results[False]
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 300
    status, _, text = results[True]
    assert status == 200 and text.rstrip().endswith("data: [DONE]") and "error" not in text


def test_more_clients_than_file_descriptors_get_503s_not_a_flood_of_tracebacks(tiny_pair):
    """Under ``ulimit -n 256`` the connection cap is lowered to fit, 400 idle clients get 503s
    beyond it, /health answers (a JSON body, no hang), and the log holds a few lines, not one
    traceback per failed accept."""
    import urllib.error
    import urllib.request

    target, _ = tiny_pair
    port = free_port()
    proc = _start_serve(target, port, files=256)
    held = []
    try:
        for _ in range(400):
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            except OSError:
                break
        try:  # answered, not hung (the timeout only catches a hang: a busy machine is slow)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as resp:
                status, body = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read()
        assert status in (200, 503) and json.loads(body)
        time.sleep(2)  # an accept loop that fails would log thousands of lines by now
    finally:
        for sock in held:
            sock.close()
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "lowered to" in err and "ulimit -n" in err
    assert err.count("Too many open files") <= 2 and len(err.splitlines()) < 30, err[-2000:]


def test_stalled_clients_are_timed_out_and_capped(tiny_pair):
    """Partial headers, a stalled body and too many connections: each ends on its own, the
    server stays healthy meanwhile, and each cause is logged once, not per connection."""
    import urllib.request

    target, _ = tiny_pair
    port = free_port()
    proc = _start_serve(target, port, "--header-timeout", "1.5", "--body-timeout", "1", "--max-connections", "60",
                        "--max-connections-per-client", "0", "--log-level", "warning")
    stalled = []
    try:
        for i in range(40):  # half a request line, or nothing at all
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 2:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            stalled.append(sock)
        start = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            assert resp.status == 200 and time.monotonic() - start < 1.0  # healthy while they are held

        body = socket.create_connection(("127.0.0.1", port), timeout=10)  # headers, then a stalled body
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
        answer = read_until(body, b'"request_timeout"').decode()
        assert answer.startswith("HTTP/1.1 408") and '"request_timeout"' in answer
        assert body.recv(1) == b""  # and the server closed it

        extra = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(30)]
        refused = [read_until(s, b"too_many_connections").decode() for s in extra[-5:]]  # beyond 60 + the /health reserve
        assert all(r.startswith("HTTP/1.1 503") and "too_many_connections" in r for r in refused)
        assert all(s.recv(1) == b"" for s in extra[-5:])  # each closed after its answer

        time.sleep(2.0)  # past the header deadline: every stalled connection is closed by the server
        for sock in stalled:
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
    finally:
        for sock in stalled:
            sock.close()
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    lines = [line for line in stderr.splitlines() if "sent no complete request headers" in line]
    assert len(lines) == 1 and "Traceback" not in stderr
    assert len([line for line in stderr.splitlines() if "beyond --max-connections" in line]) == 1
