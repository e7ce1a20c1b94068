"""Penalties and logit bias stay exact under speculation (tiny models): the pure function against
the definitions written out by hand, each verify row penalised with the tokens before it (chains
and trees), every method reproducing penalised plain decoding, the penalised sampling law, and
the fields on the server and the CLI."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence

import openai
import pytest
import torch
from server_support import LiveServer, assert_openai_error

import specdecode.engine.generation as generation
from specdecode import LLM, Constraint, SamplingParams
from specdecode.cli import main as cli_main
from specdecode.errors import InvalidSamplingParamsError
from specdecode.sample.penalties import TokenCounts, apply_penalties
from specdecode.sample.sampling import logits_to_probs
from specdecode.sequence import DraftProposal
from specdecode.server.app import create_app
from specdecode.server.scheduler import Scheduler
from tests.conftest import spec_k
from tests.test_lossless import _prompt
from tests.methods import SPEC_METHODS, RandomK
from tests.test_sampling_lossless import TRIALS, _prompt_with_likely_continuations, chi2_critical, sampled_outputs

A, B, C = ord("a"), ord("b"), ord("c")  # byte tokens of the tiny tokenizer
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3, logit_bias={A: 3.0})


def reference(row: Sequence[float], params: SamplingParams, prompt: Sequence[int],
              output: Sequence[int]) -> list[float]:
    """One row by the definitions, in Python floats: bias, then repetition over prompt and output,
    then frequency and presence over the output."""
    out = [float(x) for x in row]
    for token, bias in params.logit_bias or ():
        out[token] += bias
    r = params.repetition_penalty
    for token in set(prompt) | set(output):
        out[token] = out[token] / r if out[token] > 0 else out[token] * r
    for token, n in Counter(output).items():
        out[token] -= params.frequency_penalty * n + params.presence_penalty
    return out


def _penalised(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
               paths: list[list[int]]) -> torch.Tensor:
    counts = TokenCounts(prompt, params)
    counts.count(prompt + output, len(prompt))
    return counts.apply(logits, paths)


# --- the pure function -------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [
    dict(presence_penalty=0.8), dict(presence_penalty=-1.5), dict(frequency_penalty=0.6),
    dict(repetition_penalty=1.7), dict(repetition_penalty=0.6), dict(logit_bias={2: 5.0, 9: -100.0}),
    dict(presence_penalty=0.3, frequency_penalty=-0.4, repetition_penalty=1.2, logit_bias={3: 2.5, 11: -1.0}),
], ids=["presence", "negative-presence", "frequency", "repetition", "repetition-below-1", "bias", "combined"])
def test_each_penalty_follows_its_definition(settings):
    params = SamplingParams(**settings)
    prompt, output = [1, 2, 3, 7], [3, 4, 4, 5, 4, 11]
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(0)) * 3
    got = _penalised(logits, params, prompt, output, [[], [], []])
    for row in range(3):
        torch.testing.assert_close(got[row], torch.tensor(reference(logits[row].tolist(), params, prompt, output)))
    assert params.penalised and not SamplingParams().penalised


def test_order_is_bias_then_repetition_then_frequency_then_presence():
    """A logit of -1 with bias 4, repetition 2, frequency 0.5 (once) and presence 0.25: bias first
    gives 3, then 1.5, then 1.0, then 0.75; any other order gives another number."""
    params = SamplingParams(logit_bias={0: 4.0}, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    logits = torch.tensor([[-1.0, 1.0, 2.0]])
    got = _penalised(logits, params, prompt=[2], output=[0], paths=[[]])
    assert got.tolist() == [[0.75, 1.0, 1.0]]  # token 2: only in the prompt, so only the repetition penalty
    assert logits.tolist() == [[-1.0, 1.0, 2.0]]  # the input is left alone


def test_presence_and_frequency_count_only_the_output():
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    got = _penalised(torch.zeros(1, 4), params, prompt=[1, 1, 2], output=[2, 3, 3], paths=[[]])
    assert got.tolist() == [[0.0, 0.0, -2.0, -3.0]]


def test_apply_penalties_touches_only_the_given_columns():
    params = SamplingParams(frequency_penalty=1.0, logit_bias={5: 1.0})
    logits = torch.zeros(2, 6)
    got = apply_penalties(logits, params, torch.tensor([1, 3]), torch.tensor([[1.0, 0.0], [2.0, 1.0]]),
                          torch.tensor([False, False]))
    assert got.tolist() == [[0, -1, 0, 0, 0, 1], [0, -2, 0, -1, 0, 1]]


def test_bad_values_are_named_errors():
    for settings, words in [(dict(presence_penalty=2.5), "presence_penalty"),
                            (dict(frequency_penalty=math.nan), "frequency_penalty"),
                            (dict(repetition_penalty=0.0), "repetition_penalty"),
                            (dict(logit_bias={-1: 1.0}), "token ids"), (dict(logit_bias={"5": 1.0}), "token ids"),
                            (dict(logit_bias={5: 101}), r"\[-100, 100\]"), (dict(logit_bias=[(5, 1), (5, 2)]), "twice"),
                            (dict(logit_bias=7), "map token ids")]:
        with pytest.raises(InvalidSamplingParamsError, match=words):
            SamplingParams(**settings)
    params = SamplingParams(logit_bias={9: 1, 2: -3.5})
    assert params.logit_bias == ((2, -3.5), (9, 1.0))
    assert hash(params) == hash(SamplingParams(logit_bias={2: -3.5, 9: 1}))


# --- each verify row counts the drafts before it ----------------------------------------------


def test_row_paths_are_the_drafts_before_each_row():
    chain = DraftProposal(torch.tensor([7, 8, 9]), None)
    assert chain.row_paths() == [[], [7], [7, 8], [7, 8, 9]]
    tree = DraftProposal(torch.tensor([7, 8, 9, 6, 5]), None, (-1, -1, 0, 2, 1))
    assert tree.row_paths() == [[], [7], [8], [7, 9], [7, 9, 6], [8, 5]]


@pytest.mark.parametrize("parents", [None, (-1, -1, 0, 2, 0, 1)], ids=["chain", "tree"])
def test_each_row_is_penalised_with_the_output_and_its_own_drafts(parents):
    params = SamplingParams(**PENALTIES)
    prompt, output = [B, 5, 6], [A, C, C]
    drafts = [C, A, 5, C, 9, A]
    logits = torch.randn(len(drafts) + 1, 260, generator=torch.Generator().manual_seed(1)) * 4
    proposal = DraftProposal(torch.tensor(drafts), None, parents)
    # the drafts before each row, written out
    paths = ([[], [C], [C, A], [C, A, 5], [C, A, 5, C], [C, A, 5, C, 9], [C, A, 5, C, 9, A]] if parents is None
             else [[], [C], [A], [C, 5], [C, 5, C], [C, 9], [A, A]])
    got = _penalised(logits, params, prompt, output, proposal.row_paths())
    for row, path in enumerate(paths):
        want = torch.tensor(reference(logits[row].tolist(), params, prompt, output + path))
        torch.testing.assert_close(got[row], want)


@pytest.fixture(scope="module")
def llm(tiny_pair, tiny_pair_heads):
    target, draft = tiny_pair
    return LLM(model=str(target), draft=str(draft), max_seq_len=512, progress=False, **tiny_pair_heads)


@pytest.mark.parametrize("method", ["draft_model", "tree"])
def test_generation_penalises_each_verify_row_with_the_tokens_before_it(llm, method, monkeypatch):
    """Every row the acceptance rule reads equals the target's logits after the committed tokens
    and that row's drafts, penalised by hand with those tokens (a fresh forward per row)."""
    seen: list[tuple[list[int], list[list[int]], torch.Tensor]] = []
    real = generation.verify

    def spy(proposal, logits, params, keys=None):  # noqa: ANN001, ANN202
        gen = current[0]
        seen.append((list(gen.seq.token_ids), proposal.row_paths(), logits.clone()))
        return real(proposal, logits, params, keys)

    monkeypatch.setattr(generation, "verify", spy)
    begin, current = llm.engine.begin, []
    monkeypatch.setattr(llm.engine, "begin", lambda *a, **kw: current.append(begin(*a, **kw)) or current[-1])
    params = SamplingParams(max_tokens=12, ignore_eos=True, **PENALTIES)
    prompt = llm.tokenizer.encode("abc abc ab")
    llm.engine.generate(prompt, params, llm.drafter(method), spec_k(3, adaptive=False))
    assert any(len(paths) > 1 for _, paths, _ in seen)
    target, rows = llm.target, 0
    for committed, paths, logits in seen[:4]:
        for row, path in enumerate(paths):
            ids = committed + path
            raw = target.forward(torch.tensor(ids), target.new_cache(len(ids) + 1), last_only=True)[0]
            want = reference(raw.tolist(), params, prompt, ids[len(prompt):])
            torch.testing.assert_close(logits[row], torch.tensor(want), atol=1e-4, rtol=1e-4)
            rows += 1
    assert rows > 4


# --- exactness: greedy identity, seeded sampling, the sampled law ------------------------------


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_greedy_identity_with_penalties(llm, method):
    """Tokens and logprobs (of the penalised logits) are plain decoding's, bit for bit."""
    params = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=2, **PENALTIES)
    drafted = 0
    for seed in range(3):
        plain = llm.generate(_prompt(seed), params, method="none")[0]
        for k in (2, 5):
            spec = llm.generate(_prompt(seed), params, method=method, num_speculative_tokens=k, adaptive=False)[0]
            assert spec.token_ids == plain.token_ids, (method, seed, k)
            assert spec.logprobs == plain.logprobs
            drafted += spec.stats.draft_tokens
    assert drafted > 0


def test_penalties_change_the_output(llm):
    """So the identity above is a test: each setting alone moves greedy output somewhere."""
    prompts = [_prompt(seed) for seed in range(3)]
    free = [llm.generate(p, SamplingParams(max_tokens=32, ignore_eos=True), method="none")[0].token_ids
            for p in prompts]
    for name, value in [*PENALTIES.items()]:
        params = SamplingParams(max_tokens=32, ignore_eos=True, **{name: value})
        assert any(llm.generate(p, params, method="none")[0].token_ids != ids for p, ids in zip(prompts, free)), name
    biased = llm.generate(prompts[0], SamplingParams(max_tokens=8, logit_bias={A: 100.0}), method="none")[0]
    assert biased.token_ids == [A] * 8


@pytest.mark.parametrize("method", ["draft_model", "tree", "lookahead"])
def test_penalties_come_before_the_grammar_mask(llm, method):
    """A bias of +100 on a token the grammar forbids moves nothing out of the grammar; speculative
    output is constrained plain decoding's with the same penalties."""
    params = SamplingParams(max_tokens=12, constraint=Constraint("regex", "[abc]{2,10}"),
                            presence_penalty=1.0, logit_bias={ord("z"): 100.0, B: 2.0})
    for prompt in ("abc abc", "cab ba"):
        plain = llm.generate(prompt, params, method="none")[0]
        assert re.fullmatch("[abc]{2,10}", plain.text)
        spec = llm.generate(prompt, params, method=method, num_speculative_tokens=4, adaptive=False)[0]
        assert spec.token_ids == plain.token_ids


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_seeded_sampling_with_penalties_equals_plain_sampling(llm, method, monkeypatch):
    """Race keys make the sampled tokens plain sampling's whatever K each step drew (RandomK)."""
    monkeypatch.setattr(llm.engine, "policy", RandomK(seed=len(method)))
    for seed, (t, k) in enumerate([(0.8, 0), (1.2, 12)]):
        params = SamplingParams(max_tokens=20, temperature=t, top_k=k, seed=seed, **PENALTIES)
        plain = llm.generate(_prompt(seed), params, method="none")[0]
        spec = llm.generate(_prompt(seed), params, method=method, num_speculative_tokens=4)[0]
        assert spec.token_ids == plain.token_ids, (method, seed)


def _exact_joint(llm: LLM, prompt: list[int], params: SamplingParams, depth: int) -> dict[tuple[int, ...], float]:
    """The law of the first ``depth`` tokens, by the target alone and ``reference``'s penalties."""
    target, out = llm.target, {}

    def walk(prefix: list[int], mass: float) -> None:
        if len(prefix) == depth:
            out[tuple(prefix)] = mass
            return
        ids = prompt + prefix
        raw = target.forward(torch.tensor(ids), target.new_cache(len(ids) + 1), last_only=True)[0]
        logits = torch.tensor([reference(raw.tolist(), params, prompt, prefix)])
        probs = logits_to_probs(logits, params)[0]
        for token in torch.nonzero(probs).flatten().tolist():
            walk(prefix + [token], mass * float(probs[token]))

    walk([], 1.0)
    return out


def test_sampled_law_with_penalties_is_exact(llm):
    """Three tokens at top_k = 3 (27 cells): speculative sampling (a draft model with its own
    distribution, so acceptance and rejection both happen) matches the penalised target's law,
    computed without the engine; the penalties move that law far from the unpenalised one."""
    settings = dict(temperature=1.0, top_k=3, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5,
                    repetition_penalty=1.5, logit_bias={A: 1.0})
    ids = _prompt_with_likely_continuations(llm, SamplingParams(max_tokens=3, temperature=1.0, top_k=3))
    exact = _exact_joint(llm, ids, SamplingParams(max_tokens=3, **settings), depth=3)
    free = _exact_joint(llm, ids, SamplingParams(max_tokens=3, temperature=1.0, top_k=3), depth=3)
    assert len(exact) == 27 and math.isclose(sum(exact.values()), 1.0, rel_tol=1e-5)
    assert sum(abs(exact.get(c, 0.0) - free.get(c, 0.0)) for c in exact.keys() | free.keys()) > 0.2
    trials, counts, drafted, accepted = TRIALS, Counter(), 0, 0
    params = SamplingParams(max_tokens=4, **settings)
    for out in sampled_outputs(llm, ids, params, lambda: llm.new_drafter("draft_model"), spec_k(2, adaptive=False),
                               trials):
        counts[tuple(out.token_ids[:3])] += 1
        drafted += out.stats.draft_tokens
        accepted += out.stats.accepted_tokens
    assert set(counts) <= set(exact) and drafted > 0 and 0 < accepted < drafted
    stat, dof, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for cell, p in exact.items():  # cells expected fewer than 5 times are pooled
        if p * trials < 5:
            pool_obs, pool_exp = pool_obs + counts[cell], pool_exp + p * trials
            continue
        stat, dof = stat + (counts[cell] - p * trials) ** 2 / (p * trials), dof + 1
    if pool_exp > 0:
        stat, dof = stat + (pool_obs - pool_exp) ** 2 / pool_exp, dof + 1
    assert dof >= 5 and stat < chi2_critical(dof), f"chi2 {stat:.1f} with {dof} dof"


def test_a_bias_outside_the_vocabulary_is_a_named_error(llm):
    with pytest.raises(InvalidSamplingParamsError, match="outside the vocabulary"):
        llm.generate("hi", SamplingParams(logit_bias={260: 1.0}))


# --- the server and the CLI --------------------------------------------------------------------

MODEL = "tiny-pair"
FIELDS = {"presence_penalty": 0.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3, "logit_bias": {str(A): 3}}


@pytest.fixture(scope="module")
def live(tiny_pair):
    target, draft = tiny_pair
    served = LLM(model=str(target), draft=str(draft), method="draft_model", num_speculative_tokens=4,
                 adaptive=False, max_seq_len=512, progress=False)
    scheduler = Scheduler(served, max_concurrency=2, max_queue=8)
    with LiveServer(create_app(served, scheduler, served_model_name=MODEL)) as server:
        yield server
    scheduler.close()


def test_server_takes_the_fields_and_answers_like_the_library(live, llm):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    params = SamplingParams(max_tokens=16, **PENALTIES)
    extra = {"repetition_penalty": 1.3}  # vLLM's field, outside the openai client's signature
    resp = client.completions.create(model=MODEL, prompt="abc abc", max_tokens=16, temperature=0,
                                     presence_penalty=0.5, frequency_penalty=0.7, logit_bias={str(A): 3},
                                     extra_body=extra)
    assert resp.choices[0].text == llm.generate("abc abc", params, method="none")[0].text
    assert resp.choices[0].text != llm.generate("abc abc", SamplingParams(max_tokens=16), method="none")[0].text
    messages = [{"role": "user", "content": "Say hi."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                          presence_penalty=0.5, frequency_penalty=0.7, logit_bias={str(A): 3},
                                          extra_body=extra)
    assert chat.choices[0].message.content == llm.chat(messages, params).text


@pytest.mark.parametrize("field, value, words", [
    ("presence_penalty", 2.5, "less than or equal to 2"),
    ("frequency_penalty", -3, "greater than or equal to -2"),
    ("repetition_penalty", 0, "greater than 0"),
    ("repetition_penalty", "1.2", "valid number"),
    ("logit_bias", {"abc": 1}, "token ids"),
    ("logit_bias", {"-5": 1}, "token ids"),
    ("logit_bias", {"5": 101}, "[-100, 100]"),
    ("logit_bias", {"5": "1"}, "[-100, 100]"),
    ("logit_bias", [5], "map token ids"),
    ("logit_bias", {"260": 1}, "outside the vocabulary [0, 260)"),
])
def test_bad_values_get_a_400_naming_the_field(live, field, value, words):
    for path, body in [("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions",
                                                             {"messages": [{"role": "user", "content": "a"}]})]:
        status, got = live.post(path, {"model": MODEL, "max_tokens": 2, field: value, **body})
        err = assert_openai_error(status, got, 400)
        assert err["param"] == field and words in err["message"], err


def test_cli_flags(tiny_pair, llm, capsys):
    target, _ = tiny_pair
    args = ["generate", "--model", str(target), "--prompt", "abc abc", "--max-tokens", "10", "--json",
            "--presence-penalty", "0.5", "--frequency-penalty", "0.7", "--repetition-penalty", "1.3",
            "--logit-bias", f"{A}=3", "--logit-bias", f"{B}=-1.5"]
    assert cli_main(args) == 0
    report = json.loads(capsys.readouterr().out)
    params = SamplingParams(max_tokens=10, **{**PENALTIES, "logit_bias": {A: 3.0, B: -1.5}})
    assert report["token_ids"] == llm.generate("abc abc", params, method="none")[0].token_ids
    assert cli_main(args[:-2] + ["--presence-penalty", "3"]) == 2
    assert "presence_penalty must be" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli_main(args + ["--logit-bias", "97:3"])
    assert exit_.value.code == 2 and "expected ID=BIAS" in capsys.readouterr().err
