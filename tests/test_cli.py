"""The CLI: JSON contract, --compare, and one-line errors with exit code 2."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest

from specdecode.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``specdecode ARGS`` as a finished process: exit code, stdout and stderr. It runs in this
    process, through ``main`` as ``python -m specdecode.cli`` runs it (whose errors and messages
    go to whatever ``sys.stderr`` is), which saves the 3-4 s a new interpreter takes to import
    torch; tests/test_server_cli.py runs real processes where signals and exits matter."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: --help, usage errors
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    return subprocess.CompletedProcess(["specdecode", *args], code, out.getvalue(), err.getvalue())


def test_generate_json_compare(tiny_pair):
    target, draft = tiny_pair
    res = run_cli("generate", "--model", str(target), "--draft", str(draft), "--method", "draft_model",
                  "-k", "3", "--prompt", "abc abc abc", "--max-tokens", "12", "--compare", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)  # exactly one JSON object on stdout
    for key in ("text", "token_ids", "method", "tokens_per_s", "acceptance_rate", "mean_acceptance_length",
                "baseline_tokens_per_s", "speedup", "identical"):
        assert key in report
    assert report["method"] == "draft_model"
    assert report["identical"] is True
    assert len(report["token_ids"]) <= 12


def test_generate_streams_text(tiny_pair):
    target, _ = tiny_pair
    res = run_cli("generate", "--model", str(target), "--method", "ngram", "--prompt", "xyz xyz",
                  "--max-tokens", "5")
    assert res.returncode == 0, res.stderr
    assert "[ngram]" in res.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "no-such-model"], "no-such-model"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "prompt-file"),
        (["--prompt-file", "/dev/zero"], "larger than 16 MiB"),
        (["--prompt-file", "BINARY"], "is not UTF-8 text"),
        (["--prompt-file", "NUL"], "NUL bytes"),
        (["--temperature", "1", "--seed", str(2**70)], "seed must be an integer"),
        (["--bogus-flag"], "unrecognized arguments: --bogus-flag (see specdecode --help)"),
        (["--max-tokens", "many"], "invalid int value"),
    ],
)
def test_bad_input_is_one_line_exit_2(tiny_pair, tmp_path, args, message):
    target, _ = tiny_pair
    files = {"BINARY": b"\x89PNG\r\n\x1a\n\xff\xfe", "NUL": b"abc\x00def"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    args = [str(tmp_path / a) if a in files else a for a in args]
    base = ["generate", "--model", str(target)]
    if "--prompt-file" not in args:
        base += ["--prompt", "hi"]
    if args[0] == "--model":
        base = ["generate", "--prompt", "hi"]
    res = run_cli(*base, *args)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_json_errors_are_one_json_object_on_stdout(tiny_pair):
    """--json promises exactly one JSON object on stdout: a user error is that object (exit 2),
    beside its one line on stderr; a missing draft names the CLI's flag."""
    target, _ = tiny_pair
    res = run_cli("generate", "--model", str(target), "--method", "draft_model", "--prompt", "hi", "--json")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    error = json.loads(res.stdout)["error"]
    assert error["type"] == "InvalidConfigError" and "--draft" in error["message"]


def test_prompt_too_long(tiny_pair):
    target, _ = tiny_pair
    res = run_cli("generate", "--model", str(target), "--prompt", "a" * 600, "--max-seq-len", "256")
    assert res.returncode == 2 and "prompt" in res.stderr and "Traceback" not in res.stderr


def test_vocab_mismatch(tiny_models, tiny_pair):
    target, _ = tiny_pair
    res = run_cli("generate", "--model", str(target), "--draft", str(tiny_models["llama"]),
                  "--method", "draft_model", "--prompt", "hi")
    assert res.returncode == 2
    assert "260" in res.stderr and "96" in res.stderr


def test_help_lists_every_command():
    res = run_cli("--help")
    assert res.returncode == 0
    for cmd in ("generate", "models", "verify-cost"):
        assert cmd in res.stdout


HELP_IMPORTS = """
import sys
from specdecode.cli import COMMANDS, main
for command in ([], *([name] for name in COMMANDS if name != "index")):
    try:
        main([*command, "--help"])
    except SystemExit:
        pass
    heavy = sorted(m for m in ("torch", "tokenizers", "safetensors", "numpy") if m in sys.modules)
    print("imports after", " ".join(["specdecode", *command, "--help"]), heavy)
"""


def test_help_imports_no_heavy_library():
    """`specdecode --help` and every command's but index's (numpy, for its datastore) read no module
    that imports torch: a new process prints the top-level help in 0.2 s this way, against 4 s
    importing every command. One process asks for them in turn and names the first that did."""
    res = subprocess.run([sys.executable, "-c", HELP_IMPORTS], capture_output=True, text=True, check=True)
    lines = [line for line in res.stdout.splitlines() if line.startswith("imports after")]
    assert len(lines) == 10 and "usage: specdecode generate" in res.stdout
    assert all(line.endswith("[]") for line in lines), lines


def test_verify_cost_prints_ratios(tiny_pair):
    target, _ = tiny_pair
    res = run_cli("verify-cost", "--model", str(target), "-k", "2", "-k", "4", "--context", "16",
                  "--repeat", "2", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert set(report["verify"]) == {"2", "4"}
    for k, row in report["verify"].items():
        assert row["rows"] == int(k) + 1
        assert row["ratio"] == pytest.approx(row["seconds"] / report["one_token_s"])


def test_models_list_json():
    res = run_cli("models", "list", "--json")
    assert res.returncode == 0, res.stderr
    names = {m["name"] for m in json.loads(res.stdout)}
    assert {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"} <= names


def test_models_pull_unknown_name_exit_2():
    res = run_cli("models", "pull", "nope-7b")
    assert res.returncode == 2 and "nope-7b" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("method", ["tree", "lookahead", "suffix", "self"])
def test_generate_runs_every_new_method_identically(tiny_pair, method):
    target, draft = tiny_pair
    res = run_cli("generate", "--model", str(target), "--draft", str(draft), "--method", method,
                  "--prompt", "abc abc abc abc", "--max-tokens", "16", "--compare", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["method"] == method and report["identical"] is True


def test_suffix_with_a_datastore_from_index_build(tiny_pair, tmp_path):
    target, _ = tiny_pair
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    store = tmp_path / "store"
    built = run_cli("index", "build", str(docs), "-o", str(store), "--model", str(target), "--no-progress")
    assert built.returncode == 0, built.stderr
    res = run_cli("generate", "--model", str(target), "--method", "suffix", "--datastore", str(store),
                  "--prompt", "the quick brown", "--max-tokens", "12", "--compare", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["identical"] is True
    missing = run_cli("generate", "--model", str(target), "--method", "suffix", "--datastore",
                      str(tmp_path / "nope"), "--prompt", "x")
    assert missing.returncode == 2 and "index build" in missing.stderr


def test_lookahead_settings_are_flags_and_bad_ones_exit_2(tiny_pair):
    target, _ = tiny_pair
    res = run_cli("generate", "--model", str(target), "--method", "lookahead", "--lookahead-window", "2",
                  "--lookahead-ngram", "4", "--lookahead-candidates", "1", "--prompt", "ab ab ab",
                  "--max-tokens", "10", "--compare", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["identical"] is True
    bad = run_cli("generate", "--model", str(target), "--method", "lookahead", "--lookahead-ngram", "1",
                  "--prompt", "x")
    assert bad.returncode == 2 and "ngram" in bad.stderr


def test_datastore_without_suffix_is_noted(tiny_pair, tmp_path):
    target, _ = tiny_pair
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("some text to index\n")
    assert run_cli("index", "build", str(docs), "-o", str(tmp_path / "s"), "--model", str(target),
                   "--no-progress").returncode == 0
    res = run_cli("generate", "--model", str(target), "--method", "ngram", "--datastore", str(tmp_path / "s"),
                  "--prompt", "ab", "--max-tokens", "3")
    assert res.returncode == 0, res.stderr
    assert "--datastore is used by --method suffix only" in res.stderr


def test_int8_target_from_the_cli(tiny_pair, tmp_path):
    target, draft = tiny_pair
    res = run_cli("generate", "--model", str(target), "--draft", str(draft), "--method", "draft_model",
                  "--quantize", "int8", "--prompt", "abc abc abc", "--max-tokens", "12", "--compare", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["identical"] is True
    peers = run_cli("bench", "--model", str(target), "--methods", "ngram", "--workload", "code", "--limit", "1",
                    "--quantize", "int8", "--peers", "hf", "--out", str(tmp_path / "b"))
    assert peers.returncode == 2 and "--quantize" in peers.stderr and "Traceback" not in peers.stderr



def test_generate_structured_output_and_logprobs(tiny_pair, tmp_path):
    target, draft = tiny_pair
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    res = run_cli("generate", "--model", str(target), "--draft", str(draft), "--method", "draft_model",
                  "--prompt", "n =", "--max-tokens", "20", "--json-schema", str(tmp_path / "schema.json"),
                  "--logprobs", "2", "--compare", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert 0 <= json.loads(report["text"])["n"] <= 99 and report["identical"] is True
    assert len(report["logprobs"]) == len(report["token_ids"])
    assert all(1 <= len(lp["top_logprobs"]) <= 2 for lp in report["logprobs"])  # only tokens the schema allows
    res = run_cli("generate", "--model", str(target), "--prompt", "pick", "--choice", "left", "--choice", "right")
    assert res.returncode == 0 and res.stdout.strip() in ("left", "right"), res.stderr
    res = run_cli("generate", "--model", str(target), "--prompt", "x", "--regex", "[a-")
    assert res.returncode == 2 and "regex constraint is not valid" in res.stderr
    assert "Traceback" not in res.stderr


def test_library_messages_reach_stderr_as_plain_lines(capsys):
    """The CLI shows the library's log records as the bare text on the current stderr, once each,
    however many times ``main`` configured it."""
    import logging

    from specdecode.cli import log_to_stderr

    log_to_stderr()
    log_to_stderr()
    logging.getLogger("specdecode.models.packed").warning("specdecode: the packed cache m is damaged")
    logging.getLogger("specdecode.files").info("waiting for another process doing a build ...")
    assert capsys.readouterr().err == ("specdecode: the packed cache m is damaged\n"
                                       "waiting for another process doing a build ...\n")


def test_compare_prints_speedup_and_identity_and_a_prediction_is_counted(tiny_pair, tmp_path, capsys):
    """``generate --compare`` (text output) reports the speedup and identity; a prediction file is
    drafted from and counted, and changes nothing in the output."""
    from specdecode.cli import main

    target, _ = tiny_pair
    assert main(["generate", "--model", str(target), "--method", "none", "--prompt", "def f(x):",
                 "--max-tokens", "12", "--compare"]) == 0
    out, err = capsys.readouterr()
    assert "identical to plain decoding: True" in err
    (tmp_path / "p.txt").write_text(out.rstrip("\n"))
    assert main(["generate", "--model", str(target), "--method", "none", "--prompt", "def f(x):",
                 "--max-tokens", "12", "--compare", "--prediction-file", str(tmp_path / "p.txt")]) == 0
    out2, err2 = capsys.readouterr()
    assert out2 == out and "identical to plain decoding: True" in err2 and "prediction tokens" in err2


def test_demo_runs_every_method_in_interleaved_rounds_and_shows_the_fastest():
    """``specdecode demo``'s measure on a drifting host: every method once per round, in turn,
    each round starting one further along, and per method its fastest run."""
    from types import SimpleNamespace

    from specdecode.cli.demo import fastest, interleaved_runs

    order: list[str] = []
    speeds = iter([10.0, 12.0, 9.0, 13.0, 8.0, 11.0])  # a, b, c, then b, c, a

    def generate(method: str) -> SimpleNamespace:
        order.append(method)
        return SimpleNamespace(method=method, stats=SimpleNamespace(tokens_per_s=next(speeds)))

    runs = interleaved_runs(generate, ("a", "b", "c"), rounds=2)
    assert order == ["a", "b", "c", "b", "c", "a"]
    assert {m: [o.stats.tokens_per_s for o in outs] for m, outs in runs.items()} == \
        {"a": [10.0, 11.0], "b": [12.0, 13.0], "c": [9.0, 8.0]}
    assert [fastest(runs[m]).stats.tokens_per_s for m in "abc"] == [11.0, 13.0, 9.0]


@pytest.mark.parametrize("rounds", ["0", "-1", "two"])
def test_demo_refuses_rounds_below_one(rounds):
    res = run_cli("demo", "--rounds", rounds)
    assert res.returncode == 2 and "--rounds" in res.stderr and "Traceback" not in res.stderr
