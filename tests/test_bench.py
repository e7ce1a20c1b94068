"""The benchmark harness on tiny models: runner, output shapes, Spec-Bench loader, identity check,
Hugging Face peers, the endpoint client (against a loopback SSE server) and CLI errors."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specdecode.bench.endpoint import EndpointError, endpoint_url, sse_data, stream_completion
from specdecode.bench.runner import Contestant, first_difference, our_contestants, plan_runs, run_benchmark
from specdecode.bench.specbench import load_specbench
from specdecode.bench.workloads import last_code_block
from specdecode.bench.report import render_markdown
from specdecode.bench.summary import summarize
from specdecode.bench.workloads import (
    WORKLOAD_NAMES, Prompt, limit_per_category, load_workloads, parse_workload_names,
)
from specdecode.cli import main
from specdecode.params import SamplingParams
from specdecode.errors import InvalidConfigError
from tests.conftest import make_tiny_llm

ISSUE_METHOD_KEYS = ("tokens_per_s", "speedup_vs_none", "mean_acceptance_length", "acceptance_rate",
                     "acceptance_by_position", "ttft_s", "tpot_s", "identical_to_none")
ROW_KEYS = ("prompt_id", "category", "turn", "repeat", "method", "base_method", "k", "kind", "prompt_tokens",
            "completion_tokens", "prefill_s", "ttft_s", "decode_s", "total_s", "tokens_per_s", "tpot_s",
            "drafts", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
            "accepted_per_position", "drafted_per_position", "identical", "first_mismatch", "token_ids")


def bench(tmp_path: Path, *args: str) -> tuple[int, dict, list[dict]]:
    out = tmp_path / "out"
    code = main(["bench", "--no-progress", "--out", str(out), *args])
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()] \
        if (out / "results.jsonl").exists() else []
    return code, summary, rows


def pair_args(tiny_pair) -> list[str]:
    target, draft = tiny_pair
    return ["--model", str(target), "--draft", str(draft)]


# --- workloads and the Spec-Bench loader --------------------------------------------------------

def test_builtin_workloads_have_enough_distinct_prompts():
    for name in WORKLOAD_NAMES:
        prompts = load_workloads([name])
        assert len(prompts) >= 8, name
        assert len({p.turns for p in prompts}) == len(prompts), f"{name} repeats a prompt"
        assert all(p.category == name and p.turns[0].strip() for p in prompts)
    assert parse_workload_names("all") == list(WORKLOAD_NAMES)
    assert parse_workload_names("code, chat,code") == ["code", "chat"]
    with pytest.raises(InvalidConfigError, match="nope"):
        parse_workload_names("code,nope")
    limited = limit_per_category(load_workloads(list(WORKLOAD_NAMES)), 2)
    assert len(limited) == 2 * len(WORKLOAD_NAMES)


def test_the_agent_workload_is_conversations_that_all_leaves_out():
    prompts = load_workloads(["agent"])
    assert len(prompts) >= 3 and max(len(p.turns) for p in prompts) >= 10
    assert all(p.category == "agent" and all(t.strip() for t in p.turns) for p in prompts)
    assert parse_workload_names("code,agent") == ["code", "agent"] and "agent" not in parse_workload_names("all")


def test_the_agent_tools_workload_grows_by_tool_output():
    """Each turn hands over a tool's output (a listing, a file, a test run...), so a session's
    user turns alone run to thousands of characters, and ``all`` leaves it out too."""
    [session] = load_workloads(["agent-tools"])
    assert session.category == "agent-tools" and len(session.turns) == 10
    assert all(t.startswith(("You are a coding agent", "Tool output:")) for t in session.turns)
    assert sum(len(t) for t in session.turns) > 8000
    assert "agent-tools" not in parse_workload_names("all")


def test_specbench_loader_single_and_multi_turn(tmp_path):
    path = tmp_path / "question.jsonl"
    lines = [
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]},
        {"question_id": "q2", "category": "math_reasoning", "turns": ["What is 2+2?"]},
        {"question_id": 3, "turns": ["No category given."]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    prompts = load_specbench(path)
    assert prompts[0] == Prompt("81", "writing", ("Write a haiku.", "Now make it rhyme."))
    assert prompts[1].turns == ("What is 2+2?",) and prompts[1].category == "math_reasoning"
    assert prompts[2].category == "uncategorized"


@pytest.mark.parametrize("content, message", [
    ("{not json\n", ":1: not valid JSON"),
    ('{"question_id": 1, "category": "x"}\n', "'turns'"),
    ('{"question_id": 1, "turns": []}\n', "'turns'"),
    ('{"category": "x", "turns": ["a"]}\n', "question_id"),
    ('{"question_id": 1, "turns": ["a"]}\n{"question_id": 1, "turns": ["b"]}\n', "duplicate"),
    ("\n", "no questions"),
])
def test_specbench_loader_rejects_bad_files(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(InvalidConfigError, match=message):
        load_specbench(path)


# --- the runner through the CLI: rows, summary shape, outputs ----------------------------------

def test_bench_end_to_end_shapes(tiny_pair, tmp_path, capsys):
    code, summary, rows = bench(tmp_path, *pair_args(tiny_pair), "--methods", "none,draft_model",
                                "--workload", "chat,math", "--limit", "1", "--max-tokens", "12", "-k", "3",
                                "--draft-confidence", "0",  # a random tiny draft is never confident
                                "--k-schedule", "fixed")  # drafts every step, so every field has values
    assert code == 0, capsys.readouterr().err
    out = tmp_path / "out"
    for name in ("results.jsonl", "summary.json", "summary.md", "speedup_by_category.png",
                 "acceptance_by_position.png"):
        assert (out / name).is_file(), name
    # one row per (prompt, method, repeat): 2 prompts x 2 methods
    assert len(rows) == 4
    for row in rows:
        assert set(ROW_KEYS) <= set(row), set(ROW_KEYS) - set(row)
        assert row["identical"] is True and row["completion_tokens"] <= 12
        assert row["prefill_s"] > 0 and row["decode_s"] >= 0
    spec = [r for r in rows if r["method"] == "draft_model"]
    assert all(r["k"] == 3 and r["drafts"] > 0 and len(r["drafted_per_position"]) <= 3 for r in spec)

    for key in ("model", "draft", "dtype", "machine", "methods", "peers", "per_category", "advice"):
        assert key in summary, key
    assert summary["dtype"] == "float32" and summary["machine"]["cpu_count"] >= 1
    assert set(summary["methods"]) == {"none", "draft_model"}
    for m in summary["methods"].values():
        assert set(ISSUE_METHOD_KEYS) <= set(m)
        assert "speedup_vs_hf" not in m  # no peers ran
        assert m["identical_to_none"] is True
    dm = summary["methods"]["draft_model"]
    assert 1.0 <= dm["mean_acceptance_length"] <= 4.0 and 0.0 <= dm["acceptance_rate"] <= 1.0
    assert len(dm["acceptance_by_position"]) == 3
    assert dm["limit_tokens_per_s"] > 0 and dm["efficiency"] > 0
    assert 1.0 <= dm["mean_accepted_tokens"] <= dm["mean_acceptance_length"]
    assert summary["methods"]["none"]["speedup_vs_none"] == pytest.approx(1.0)
    assert summary["peers"] == {}
    assert set(summary["per_category"]) == {"chat", "math"}
    for entries in summary["per_category"].values():
        for e in entries.values():
            assert {"tokens_per_s", "speedup_vs_none", "mean_acceptance_length"} <= set(e)
    assert {"best_method", "best_k"} <= set(summary["advice"])
    assert summary["advice"]["best_method"] in ("none", "draft_model")
    assert summary["peak_rss_mb"] > 0 and summary["target_step_s"] > 0
    costs = summary["policy_costs"]  # what the policy planned on (here conftest's CostTable)
    assert costs["step_s"] > 0 and costs["row_share"] == pytest.approx(0.25)
    md = (out / "summary.md").read_text()
    assert "| draft_model | 3 |" in md and "## Advice" in md
    assert "each extra verify row 0.25 of it" in md


def test_sweep_k_rows_and_advice(tiny_pair, tmp_path):
    code, summary, rows = bench(tmp_path, *pair_args(tiny_pair), "--methods", "ngram",
                                "--workload", "code-edit", "--limit", "1", "--max-tokens", "10", "--sweep-k", "1,3")
    assert code == 0
    assert list(summary["methods"]) == ["none", "ngram@k=1", "ngram@k=3"]  # none added as the reference
    assert {r["k"] for r in rows if r["base_method"] == "ngram"} == {1, 3}
    per = summary["advice"]["per_method"]["ngram"]
    assert per["best_k"] in (1, 3) and set(per["by_k"]) == {"1", "3"}


def test_k_schedule_both_adds_fixed_rows(tiny_pair, tmp_path):
    code, summary, rows = bench(tmp_path, *pair_args(tiny_pair), "--methods", "draft_model", "--workload", "code",
                                "--limit", "1", "--max-tokens", "10", "-k", "4", "--k-schedule", "both",
                                "--draft-quantize", "int8", "--draft-confidence", "0")
    assert code == 0
    assert list(summary["methods"]) == ["none", "draft_model", "draft_model+fixed"]
    assert all(r["identical"] for r in rows if r["method"] != "none")
    fixed = [r for r in rows if r["method"] == "draft_model+fixed"]
    # fixed K: every draft has 4 tokens except where max_tokens cuts the last steps short
    assert fixed and all(r["drafted_per_position"][3] >= r["drafts"] - 2 for r in fixed)
    assert summary["settings"]["k_schedule"] == "both" and summary["settings"]["draft_quantize"] == "int8"


def test_seeded_sampled_rows_are_checked_token_for_token(tiny_pair, tmp_path):
    """A seeded sampled bench compares each method's output with plain decoding's, as a greedy one does."""
    code, summary, rows = bench(tmp_path, *pair_args(tiny_pair), "--methods", "draft_model,ngram", "--workload",
                                "code", "--limit", "2", "--max-tokens", "12", "--temperature", "0.9", "--seed", "5")
    assert code == 0
    assert all(r["identical"] is True for r in rows if r["method"] != "none")
    assert summary["methods"]["draft_model"]["identical_to_none"] is True


def test_compare_drafts_adds_rows_with_the_other_draft(tiny_pair, tmp_path):
    target, draft = tiny_pair
    other = make_tiny_llm(tmp_path / "other-draft", "qwen2", seed=10, noise=0.4, tie_word_embeddings=False)
    code, summary, rows = bench(tmp_path, *pair_args(tiny_pair), "--methods", "draft_model", "--workload", "code",
                                "--limit", "2", "--max-tokens", "12", "-k", "4", "--draft-quantize", "int8",
                                "--draft-confidence", "0", "--k-schedule", "fixed", "--compare-drafts", f"{draft},{other}")
    assert code == 0
    names = ["none", "draft_model", f"draft_model[{draft.name}]", "draft_model[other-draft]"]
    assert list(summary["methods"]) == names
    assert all(r["identical"] for r in rows if r["method"] != "none")
    by = {name: [r for r in rows if r["method"] == name] for name in names}
    # the same draft under another name drafts the same tokens; another draft does not
    assert [r["accepted_tokens"] for r in by["draft_model"]] == [r["accepted_tokens"] for r in by[names[2]]]
    assert [r["draft_tokens"] for r in by["draft_model"]] != [r["draft_tokens"] for r in by[names[3]]] or \
        [r["accepted_tokens"] for r in by["draft_model"]] != [r["accepted_tokens"] for r in by[names[3]]]
    assert f"--compare-drafts {draft},{other}" in summary["command"]


def test_multi_turn_sends_the_models_own_answer(tiny_pair, tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 7, "category": "writing", "turns": ["Say hi.", "Again."]}) + "\n")
    code, summary, rows = bench(tmp_path, *pair_args(tiny_pair), "--methods", "none,ngram",
                                "--dataset", str(path), "--max-tokens", "8")
    assert code == 0
    assert sorted((r["method"], r["turn"]) for r in rows) == [("ngram", 0), ("ngram", 1), ("none", 0), ("none", 1)]
    assert all(r["identical"] for r in rows)
    assert set(summary["per_category"]) == {"writing"}
    # Every conversation starts cold; its second turn reuses at least its first turn's prompt.
    turns = {(r["method"], r["turn"]): r for r in rows}
    for method in ("none", "ngram"):
        assert turns[method, 0]["cached_tokens"] == 0
        assert turns[method, 1]["cached_tokens"] >= turns[method, 0]["prompt_tokens"]
    assert [t["turn"] for t in summary["methods"]["none"]["by_turn"]] == [0, 1]
    assert "## TTFT per turn" in (tmp_path / "out" / "summary.md").read_text()

    from specdecode.api import LLM

    llm = LLM(*map(str, tiny_pair), method="draft_model", progress=False)
    seen: list[list[dict]] = []

    def render(messages):
        seen.append([dict(m) for m in messages])
        return llm.chat_prompt_ids(messages)

    prompt = load_specbench(path)[0]
    result = run_benchmark(our_contestants(llm, plan_runs(["none"], [2], False)), [prompt],
                           SamplingParams(max_tokens=8), render, progress=False)
    answer = result.rows[0]["text"]
    assert seen[-1] == [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": answer},
                        {"role": "user", "content": "Again."}]


# --- the identity check -------------------------------------------------------------------------

def _broken(contestant: Contestant) -> Contestant:
    """A 'speculative method' whose output differs from plain decoding at token 2."""

    def generate(ids, params):
        out = contestant.generate(ids, params)
        tampered = list(out.token_ids)
        tampered[2] = (tampered[2] + 1) % 256
        return replace(out, token_ids=tampered)

    return Contestant("broken", contestant.method, contestant.k, "ours", generate)


def test_identity_check_catches_a_broken_method(tiny_pair, capsys):
    from specdecode.api import LLM

    llm = LLM(*map(str, tiny_pair), method="draft_model", progress=False)
    contestants = our_contestants(llm, plan_runs(["none", "ngram"], [3], False))
    contestants.append(_broken(contestants[1]))
    prompts = load_workloads(["chat"])[:1]
    result = run_benchmark(contestants, prompts, SamplingParams(max_tokens=10), llm.chat_prompt_ids, progress=False)
    err = capsys.readouterr().err
    assert "IDENTITY MISMATCH" in err and "broken" in err and "at token 2" in err
    assert [f["method"] for f in result.failures] == ["broken"]
    summary = summarize(result.rows, {"model": "tiny"}, failures=result.failures)
    assert summary["methods"]["broken"]["identical_to_none"] is False
    assert summary["methods"]["broken"]["mismatches"] == 1
    assert summary["methods"]["ngram"]["identical_to_none"] is True
    assert "broken" in summary["advice"]["excluded"] and summary["advice"]["best_method"] != "broken"


def test_contestants_take_turns_running_first_and_none_stays_the_reference(tiny_pair, capsys):
    """Each prompt starts with the next contestant (A B C, B C A, C A B), so none does not always
    run first; rows are still recorded none first, and a broken method is caught whichever ran
    before it."""
    from specdecode.api import LLM

    llm = LLM(*map(str, tiny_pair), method="draft_model", progress=False)
    order: list[str] = []

    def logged(c: Contestant) -> Contestant:
        def generate(ids, params):
            order.append(c.name)
            return c.generate(ids, params)

        return replace(c, generate=generate)

    contestants = our_contestants(llm, plan_runs(["none", "ngram"], [3], False))
    contestants = [logged(c) for c in [*contestants, _broken(contestants[1])]]
    prompts = [load_workloads([w])[0] for w in ("chat", "code", "math")]
    result = run_benchmark(contestants, prompts, SamplingParams(max_tokens=10), llm.chat_prompt_ids, progress=False)
    measured = order[len(contestants):]  # after one warm-up each, in the given order
    assert measured == ["none", "ngram", "broken", "ngram", "broken", "none", "broken", "none", "ngram"]
    assert [r["method"] for r in result.rows] == ["none", "ngram", "broken"] * 3
    assert [f["method"] for f in result.failures] == ["broken"] * 3
    assert all(r["identical"] for r in result.rows if r["method"] != "broken")
    assert "IDENTITY MISMATCH" in capsys.readouterr().err


def test_cli_exits_1_and_reports_a_mismatch(tiny_pair, tmp_path, monkeypatch, capsys):
    import specdecode.bench.runner as runner

    real = runner.our_contestants
    monkeypatch.setattr(runner, "our_contestants", lambda llm, runs: [*real(llm, runs)[:1],
                                                                      _broken(real(llm, runs)[1])])
    code, summary, rows = bench(tmp_path, *pair_args(tiny_pair), "--methods", "none,ngram",
                                "--workload", "chat", "--limit", "1", "--max-tokens", "8")
    err = capsys.readouterr().err
    assert code == 1 and "IDENTITY CHECK FAILED" in err
    assert summary["methods"]["broken"]["identical_to_none"] is False
    assert [r["identical"] for r in rows if r["method"] == "broken"] == [False]
    assert "IDENTITY FAILURES" in (tmp_path / "out" / "summary.md").read_text()


# --- Hugging Face peers --------------------------------------------------------------------------

def test_peers_hf_on_the_tiny_pair(tiny_pair, tmp_path):
    code, summary, rows = bench(tmp_path, *pair_args(tiny_pair), "--methods", "none,draft_model",
                                "--workload", "math", "--limit", "1", "--max-tokens", "10", "-k", "3",
                                "--peers", "hf")
    assert code == 0
    assert set(summary["peers"]) == {"hf_target", "hf_assisted", "hf_prompt_lookup"}
    for name, peer in summary["peers"].items():
        assert peer["tokens_per_s"] > 0 and isinstance(peer["identical_to_ours"], bool), name
    assert summary["peers"]["hf_target"]["identical_to_ours"] is True  # same weights, same greedy rule
    assert summary["peers"]["hf_prompt_lookup"]["settings"]["prompt_lookup_num_tokens"] == 3
    for m in summary["methods"].values():
        assert m["speedup_vs_hf"] > 0
    assert {r["kind"] for r in rows} == {"ours", "peer"}


# --- summary arithmetic -------------------------------------------------------------------------

def _row(prompt: str, method: str, tokens: int, seconds: float, **extra) -> dict:
    base = dict(prompt_id=prompt, category="c", turn=0, repeat=0, method=method, base_method=method, k=None,
                kind="ours", completion_tokens=tokens, total_s=seconds, ttft_s=None, prefill_s=None,
                identical=True, drafts=None, draft_tokens=None, accepted_tokens=None,
                accepted_per_position=None, drafted_per_position=None)
    base.update(extra)
    return base


def test_speedup_is_the_geometric_mean_of_per_prompt_ratios():
    spec = dict(base_method="ngram", k=2, drafts=4, draft_tokens=8, accepted_tokens=4,
                accepted_per_position=[3, 1], drafted_per_position=[4, 4])
    rows = [_row("a", "none", 10, 1.0), _row("b", "none", 20, 1.0),
            _row("a", "ngram", 20, 1.0, **spec), _row("b", "ngram", 20, 1.0, **spec)]
    s = summarize(rows, {}, target_step_s=None)
    assert s["methods"]["ngram"]["speedup_vs_none"] == pytest.approx(math.sqrt(2.0))  # ratios 2 and 1
    assert s["methods"]["ngram"]["tokens_per_s"] == pytest.approx(20.0)  # 40 tokens / 2 s
    assert s["methods"]["ngram"]["acceptance_by_position"] == [0.75, 0.25]
    assert s["methods"]["ngram"]["mean_acceptance_length"] == pytest.approx(2.0)  # 1 + 8 / 8
    assert s["advice"]["best_method"] == "ngram" and s["advice"]["best_k"] == 2
    assert first_difference([1, 2, 3], [1, 2, 3]) is None and first_difference([1, 2], [1, 2, 3]) == 2


def test_speedup_interval_brackets_the_mean_within_each_categorys_spread():
    """The bootstrap interval over prompts holds the geometric mean, is reproducible, resamples
    within categories (a category whose prompts agree adds no spread, however far it lies from
    the others), and is absent with too few prompts for its percentiles to mean much."""
    def rows_of(ratios: dict[str, list[float]]) -> list[dict]:
        return [r for c, xs in ratios.items() for i, x in enumerate(xs)
                for r in (_row(f"{c}{i}", "none", 10, 1.0, category=c), _row(f"{c}{i}", "ngram", 10, 1.0 / x, category=c))]

    spread = {"a": [1.1, 1.5, 0.9, 1.3], "b": [1.2, 1.6, 1.0, 1.4], "c": [1.0, 1.2, 0.8, 1.1]}
    s = summarize(rows_of(spread), {}, target_step_s=None)
    m = s["methods"]["ngram"]
    low, high = m["speedup_vs_none_interval"]
    assert low < m["speedup_vs_none"] < high and 0.8 <= low and high <= 1.6
    assert summarize(rows_of(spread), {}, target_step_s=None)["methods"]["ngram"]["speedup_vs_none_interval"] == [low, high]
    assert s["methods"]["none"]["speedup_vs_none_interval"] is None  # the baseline against itself
    assert f"({low:.2f}-{high:.2f})" in render_markdown(s) and "bootstrap interval" in render_markdown(s)
    steady = {"a": [1.5] * 4, "b": [1.0] * 4, "c": [1.2] * 4}  # far apart, each steady
    assert summarize(rows_of(steady), {}, target_step_s=None)["methods"]["ngram"]["speedup_vs_none_interval"] == \
        pytest.approx([math.exp((math.log(1.5) + math.log(1.2)) / 3)] * 2)
    few = summarize(rows_of({"a": [1.1, 1.5, 0.9]}), {}, target_step_s=None)
    assert few["methods"]["ngram"]["speedup_vs_none_interval"] is None
    assert "bootstrap interval" not in render_markdown(few)


def test_limit_counts_every_target_forward():
    """tau leaves out steps that drafted nothing; the limit may not, or it would be unreachable."""
    spec = dict(base_method="ngram", k=8, drafts=2, draft_tokens=8, accepted_tokens=6,
                accepted_per_position=[2, 2, 2, 0], drafted_per_position=[2, 2, 2, 2])
    rows = [_row("a", "none", 11, 1.1, ttft_s=0.1, target_steps=10),
            _row("a", "ngram", 12, 1.1, ttft_s=0.1, target_steps=5, **spec)]  # 2 x 4 + 3 x 1 tokens
    s = summarize(rows, {}, target_step_s=0.1)
    none, ngram = s["methods"]["none"], s["methods"]["ngram"]
    assert none["mean_accepted_tokens"] == pytest.approx(1.0) and none["efficiency"] == pytest.approx(1.0)
    assert ngram["mean_acceptance_length"] == pytest.approx(4.0)  # vLLM's tau: drafted steps only
    assert ngram["mean_accepted_tokens"] == pytest.approx(11 / 5)
    assert ngram["limit_tokens_per_s"] == pytest.approx(22.0)
    assert ngram["efficiency"] == pytest.approx(0.5)  # 5 forwards x 0.1 s in 1.0 s of decoding
    assert "tokens/forward" in render_markdown(s)


# --- the endpoint client against a loopback SSE server ------------------------------------------

def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class _Handler(BaseHTTPRequestHandler):
    usage = True
    delay = 0.0
    status = 200
    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "body": body})
        if self.status != 200:
            self.send_error(self.status, "boom")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(self.delay)
        self.wfile.write(b": keep-alive\n\n")
        for piece in ("Hel", "lo", " world"):
            key = {"delta": {"content": piece}} if self.path.endswith("chat/completions") else {"text": piece}
            self.wfile.write(_sse({"choices": [{"index": 0, **key, "finish_reason": None}]}))
            self.wfile.flush()
            time.sleep(0.01)
        self.wfile.write(_sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
        if self.usage:
            self.wfile.write(_sse({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}))
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):  # keep test output quiet
        pass


@pytest.fixture
def sse_server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("Handler", (_Handler,), {"requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_sse_parser_handles_comments_and_multiline_data():
    lines = [b": ping\n", b"data: a\n", b"data: b\n", b"\n", b"event: x\n", b"data:c\r\n", b"\r\n", b"data: d\n"]
    assert list(sse_data(lines, time.perf_counter() + 5)) == ["a\nb", "c", "d"]


def test_endpoint_stream_counts_tokens_and_times(sse_server):
    base, handler = sse_server
    url = endpoint_url(base, "chat")
    assert url == f"{base}/v1/chat/completions"
    res = stream_completion(url, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
                            timeout=5)
    assert res.text == "Hello world" and res.completion_tokens == 4 and res.token_count_source == "usage"
    assert 0 < res.ttft_s <= res.total_s and res.finish_reason == "length" and res.prompt_tokens == 9
    handler.usage = False
    res = stream_completion(endpoint_url(base + "/v1/", "completions"), {"model": "m", "prompt": "hi"}, timeout=5,
                            api="completions")
    assert res.text == "Hello world" and res.completion_tokens == 3 and res.token_count_source == "chunks"
    assert handler.requests[-1]["path"] == "/v1/completions"


def test_endpoint_errors_are_bounded_and_named(sse_server):
    base, handler = sse_server
    handler.status = 500
    with pytest.raises(EndpointError, match="HTTP 500"):
        stream_completion(endpoint_url(base, "chat"), {}, timeout=5)
    handler.status, handler.delay = 200, 2.0
    start = time.perf_counter()
    with pytest.raises(EndpointError, match="did not answer"):
        stream_completion(endpoint_url(base, "chat"), {}, timeout=0.3)
    assert time.perf_counter() - start < 1.5


def test_bench_endpoint_cli(sse_server, tmp_path):
    base, handler = sse_server
    code, summary, rows = bench(tmp_path, "--endpoint", base, "--model", "served-model", "--workload", "chat",
                                "--limit", "2", "--max-tokens", "8")
    assert code == 0
    assert len(rows) == 2 and all(r["completion_tokens"] == 4 and r["ttft_s"] > 0 for r in rows)
    ep = summary["methods"]["endpoint"]
    assert ep["tokens_per_s"] > 0 and ep["ttft_s"] > 0 and ep["tpot_s"] > 0
    assert summary["endpoint"]["token_count_source"] == "usage"
    body = handler.requests[-1]["body"]
    assert body["model"] == "served-model" and body["stream"] is True and body["max_tokens"] == 8
    assert body["messages"][0]["role"] == "user"


# --- CLI errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--workload", "nope"], "unknown workload 'nope'"),
    (["--dataset", "/nonexistent/question.jsonl"], "--dataset /nonexistent/question.jsonl: no such file"),
    (["--dataset", "/dev/zero"], "larger than 256 MiB"),  # refused, not read into memory
    (["--workload", "code", "--sweep-k", "1,x"], "--sweep-k"),
    (["--workload", "code", "--methods", "none,bogus"], "unknown method 'bogus'"),
    (["--workload", "code", "--repeat", "0"], "--repeat"),
    (["--workload", "code", "--endpoint", "ftp://x"], "--endpoint"),
    (["--workload", "code", "--compare-drafts", ","], "--compare-drafts"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, args, message):
    code = main(["bench", "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_unreachable_endpoint_is_one_line_exit_2(tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["bench", "--no-progress", "--endpoint", f"http://127.0.0.1:{port}", "--workload", "chat",
                 "--limit", "1", "--timeout", "5", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot reach" in err and len(err.strip().splitlines()) == 1


def test_bench_help_names_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--draft", "--methods", "-k", "--sweep-k", "--workload", "--dataset", "--limit",
                 "--max-tokens", "--temperature", "--peers", "--repeat", "--out", "--endpoint"):
        assert flag in text, flag


@pytest.mark.parametrize("argv", [
    ["--workload", "code"],
    ["--model", "m", "--draft", "d", "--compare-drafts", "d2,d3", "--methods", "none,suffix,lookahead,eagle,medusa",
     "--sweep-k", "1,2,4", "--k-schedule", "both", "--draft-confidence", "0.25", "--draft-quantize", "none",
     "--quantize", "int8", "--datastore", "store dir", "--lookahead-window", "5", "--lookahead-ngram", "3",
     "--lookahead-candidates", "7", "--eagle-head", "head", "--medusa-heads", "heads", "--head-tree-width", "2",
     "--dataset", "q.jsonl", "--limit", "3", "--max-tokens", "16", "--temperature", "0.7", "--seed", "9",
     "--peers", "hf,llamacpp,vllm", "--llamacpp-server", "/bin/ls", "--llamacpp-args", "-ngl 9 --spec-draft-n-max 16",
     "--vllm-python", "py", "--vllm-args", "--tensor-parallel-size 2", "--synthetic-acceptance", "0.9,0.5",
     "--repeat", "2", "--dtype", "bfloat16", "--max-seq-len", "2048", "--no-prefix-cache",
     "--kv-cache-memory", "2GiB", "--endpoint-api", "completions",
     "--timeout", "12.5"],
    ["--workload", "chat", "-k", "3", "--endpoint", "http://127.0.0.1:1/v1", "--temperature", "1e-06"],
])
def test_reproducing_command_parses_back_to_the_same_options(argv):
    import shlex

    from specdecode.cli import build_parser
    from specdecode.cli.bench import _command

    parser = build_parser()
    args = parser.parse_args(["bench", *argv, "--out", "somewhere", "--no-progress"])
    command = shlex.split(_command(args))
    assert command[:2] == ["specdecode", "bench"] and "--out" not in command and "--no-progress" not in command
    again = parser.parse_args(command[1:] + ["--out", "somewhere", "--no-progress"])
    assert vars(again) == vars(args)
    assert command[2:4] == ["--model", args.model] and "--methods" in command  # defaults a reader needs


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # tied and untied embeddings
def test_hf_peer_shares_our_weights(tiny_models, arch):
    import torch
    from transformers import AutoModelForCausalLM

    from specdecode.bench.peers import _shared_model
    from specdecode.models.decoder import Decoder

    ours = Decoder.from_dir(tiny_models[arch])
    shared = _shared_model(tiny_models[arch], ours)
    loaded = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32)
    assert shared.model.embed_tokens.weight.data_ptr() == ours.embed.data_ptr()  # no second copy
    ids = torch.arange(12)[None] % ours.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(shared(ids).logits, loaded(ids).logits, atol=1e-5, rtol=1e-5)


def test_prediction_adds_predicted_rows(tiny_pair, tmp_path):
    """--prediction runs every method again with the prompt's code block as the predicted output:
    the outputs stay plain decoding's, and the prediction's drafts are counted."""
    code, summary, rows = bench(tmp_path, *pair_args(tiny_pair), "--methods", "ngram", "--workload", "code-edit",
                                "--limit", "1", "--max-tokens", "24", "--prediction")
    assert code == 0
    assert list(summary["methods"]) == ["none", "ngram", "none+prediction", "ngram+prediction"]
    assert all(r["identical"] for r in rows if r["method"] != "none")
    assert all(r["prediction_accepted"] == r["prediction_rejected"] == 0 for r in rows if "+" not in r["method"])


def test_predicted_runs_send_the_prompts_code_block():
    """A ``+prediction`` contestant's requests carry the prompt's last code block; the others none."""
    sent = []

    class FakeLLM:
        spec = type("S", (), {"synthetic_acceptance": None})()
        suffix_history = set()
        tokenizer = type("T", (), {"decode": staticmethod(lambda ids: "Fix:\n```py\nx = 1\n```")})()

        def generate(self, ids, params, method, k, adaptive):
            sent.append((method, params.prediction))
            return [None]

    runs = plan_runs(["ngram"], [4], sweep=False, prediction=True)
    for contestant in our_contestants(FakeLLM(), runs):
        contestant.generate([1, 2], SamplingParams(max_tokens=4))
    assert sent == [("none", None), ("ngram", None), ("none", "```py\nx = 1\n```"), ("ngram", "```py\nx = 1\n```")]


def test_last_code_block_is_the_prediction():
    text = "Fix it:\n```python\nx = 1\n```\nand this:\n```js\nlet y = 2;\n```\n<|im_end|>"
    assert last_code_block(text) == "```js\nlet y = 2;\n```"
    assert last_code_block("no code here") is None
    asked = "Return it in one ```python block.\n\n```python\ndef f():\n    return 1\n```<|im_end|>"
    assert last_code_block(asked) == "```python\ndef f():\n    return 1\n```"
