"""Structured output stays exact: every method reproduces constrained plain decoding, outputs
always match their schema, and sampling has exactly the masked target's law (tiny models)."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdecode import LLM, Constraint, SamplingParams
from specdecode.drafters.base import Drafter
from specdecode.sequence import DraftProposal
from specdecode.errors import InvalidConstraintError, InvalidSamplingParamsError
from specdecode.sample.grammar import _unpack
from specdecode.sample.sampling import logits_to_probs
from tests.conftest import EOS_ID, TINY_VOCAB, spec_k
from tests.methods import SPEC_METHODS
from tests.test_sampling_lossless import TRIALS, chi2_critical, sampled_outputs

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3}}}
CONSTRAINTS = {
    "schema": Constraint.json_schema(PERSON),
    "json_object": Constraint("json_object"),
    "regex": Constraint("regex", r"[a-z]{2,6}@[a-z]{1,5}\.(com|org)"),
    "choice": Constraint.choice(["yes", "no", "maybe"]),
    "grammar": Constraint("grammar", 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,3}/ | start'),
}
PROMPTS = ["hello {", "x = [1, 2", "def f(a):\n    return a + a"]


@pytest.fixture(scope="module")
def llm(tiny_pair, tiny_pair_heads):
    target, draft = tiny_pair
    return LLM(model=str(target), draft=str(draft), max_seq_len=512, progress=False, **tiny_pair_heads)


def _greedy(constraint: Constraint, n: int = 48, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, constraint=constraint, logprobs=logprobs)


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
@pytest.mark.parametrize("method", SPEC_METHODS)
def test_greedy_identity_with_constrained_plain_decoding(llm, method, kind):
    params = _greedy(CONSTRAINTS[kind])
    for prompt in PROMPTS:
        plain = llm.generate(prompt, params, method="none")[0]
        for k in (2, 5):
            spec = llm.generate(prompt, params, method=method, num_speculative_tokens=k)[0]
            assert spec.token_ids == plain.token_ids, (method, kind, prompt, k)
            assert spec.text == plain.text


def test_constrained_plain_decoding_matches_an_oracle(llm, tiny_pair):
    """Our `none` under a grammar equals an independent loop: transformers' logits of the whole
    sequence, llguidance's own mask, argmax."""
    from llguidance import LLMatcher
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32)
    for kind in ("schema", "regex", "grammar"):
        constraint = CONSTRAINTS[kind]
        ids = llm.tokenizer.encode(PROMPTS[0])
        matcher = LLMatcher(llm.engine.grammars.ll_tokenizer, llm.engine.grammars.grammar(constraint))
        want: list[int] = []
        while len(want) < 40:
            with torch.no_grad():
                logits = ref(torch.tensor([ids + want])).logits[0, -1]
            allowed = _unpack(matcher.compute_bitmask(), logits.shape[0])
            token = int(logits.masked_fill(~allowed, -torch.inf).argmax())
            want.append(token)
            if token == EOS_ID:
                break
            assert matcher.consume_token(token)
        got = llm.generate(PROMPTS[0], _greedy(constraint, 40), method="none")[0]
        assert got.token_ids == want, kind


_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 500)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5)),
    st.builds(lambda xs: {"enum": xs}, st.lists(st.sampled_from(["x", "yz", 3, True, None]), min_size=1,
                                                max_size=3, unique=True)),
)
_schemas = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, inner, st.integers(0, 2)),
        st.dictionaries(st.from_regex(r"[a-z]{1,4}", fullmatch=True), inner, min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props),
                           "additionalProperties": False}),
    ),
    max_leaves=5,
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=_schemas, seed=st.integers(0, 2**16), method=st.sampled_from(["none", "draft_model", "ngram"]))
def test_outputs_always_match_their_schema(llm, schema, seed, method):
    params = SamplingParams(max_tokens=300, temperature=1.0, seed=seed, constraint=Constraint.json_schema(schema))
    out = llm.generate("data: ", params, method=method, num_speculative_tokens=4)[0]
    assert out.finish_reason == "stop", (schema, out.text)
    assert _valid(json.loads(out.text), schema), (schema, out.text)


def _valid(value: object, schema: dict) -> bool:
    """A validator for the schema subset above (no dependency on a JSON-schema library)."""
    if "enum" in schema:
        return any(value == e and type(value) is type(e) for e in schema["enum"])
    kind = schema["type"]
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return type(value) is int and schema["minimum"] <= value <= schema["maximum"]
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema["maxLength"]
    if kind == "array":
        return isinstance(value, list) and len(value) <= schema["maxItems"] and all(
            _valid(v, schema["items"]) for v in value)
    return (isinstance(value, dict) and set(value) == set(schema["properties"])
            and all(_valid(value[k], s) for k, s in schema["properties"].items()))


@pytest.mark.parametrize("method", ["none", "draft_model", "tree"])
def test_sampled_outputs_match_the_regex(llm, method):
    pattern = CONSTRAINTS["regex"].spec
    for seed in range(12):
        params = SamplingParams(max_tokens=60, temperature=1.0, seed=seed, constraint=CONSTRAINTS["regex"])
        out = llm.generate("mail me at ", params, method=method)[0]
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text


def test_forced_tokens_are_drafted_without_a_drafter(llm):
    """`{"name": "` is forced by PERSON: plain decoding verifies those tokens as drafts, so it
    takes fewer target steps than tokens; they are not counted as the drafter's drafts."""
    out = llm.generate("hi", _greedy(CONSTRAINTS["schema"], 80), method="none")[0]
    assert out.text.startswith('{"name": "')
    assert out.stats.target_steps < len(out.token_ids) - 8 and out.stats.drafts == 0


def _letters_the_target_likes(llm: LLM, ids: list[int], n: int) -> list[int]:
    logits = llm.target.forward(torch.tensor(ids), llm.target.new_cache(len(ids) + 1), last_only=True)[0]
    text = {t: llm.tokenizer.decode([t]) for t in range(256)}
    return [t for t in logits.argsort(descending=True).tolist() if t < 256 and text[t].isascii()][:n]


class _UnguidedSampler(Drafter):
    """Samples each draft from a fixed q that puts mass on a token the grammar forbids, as a
    trained head does that knows nothing of the grammar: the forbidden draft must still reach
    the rejection rule, whose residual max(0, p - q) the law depends on."""

    name = "unguided"

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, seq, k):  # noqa: ANN001, ANN201
        q = torch.zeros(TINY_VOCAB)
        q[self.tokens] = torch.tensor([0.4, 0.1, 0.2, 0.3])
        drafts = torch.multinomial(q, k, replacement=True, generator=seq.generator)
        return DraftProposal(drafts, q.expand(k, -1).clone())


@pytest.mark.parametrize("method", ["draft_model", "ngram", "unguided"])
def test_sampled_law_under_a_mask_is_exact(llm, method):
    """Three tokens under the regex [xyz]{3} (x, y, z: the ASCII bytes the target favours): 27 cells whose
    exact law is the target's distribution masked to {x, y, z} and renormalized at each position,
    computed here without the grammar code. Speculative sampling must match it (chi-square). The
    draft model drafts from its own masked distribution; n-gram drafts come from the prompt."""
    ids = llm.tokenizer.encode("ab ab ab ab")
    letters = _letters_the_target_likes(llm, ids, 3)
    ids += letters * 3  # repeats give the n-gram drafter matches inside the class
    chars = "".join(f"\\x{ord(llm.tokenizer.decode([t])):02x}" for t in letters)
    constraint = Constraint("regex", f"[{chars}]{{3}}")
    base = SamplingParams(max_tokens=4, temperature=1.0)
    exact: dict[tuple[int, ...], float] = {}
    for cell in itertools.product(letters, repeat=3):
        mass = 1.0
        for i in range(3):
            prefix = ids + list(cell[:i])
            logits = llm.target.forward(torch.tensor(prefix), llm.target.new_cache(len(prefix) + 1), last_only=True)
            probs = logits_to_probs(logits, base)[0][letters].double()
            mass *= float(probs[letters.index(cell[i])] / probs.sum())
        exact[cell] = mass
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-6)
    trials, counts, drafted, accepted = TRIALS, Counter(), 0, 0
    forbidden = next(t for t in range(256) if t not in letters and llm.tokenizer.decode([t]).isalpha())
    unguided = _UnguidedSampler(letters + [forbidden])  # holds no request's state
    new_drafter = (lambda: unguided) if method == "unguided" else (lambda: llm.new_drafter(method))
    params = SamplingParams(max_tokens=4, temperature=1.0, constraint=constraint)
    for out in sampled_outputs(llm, ids, params, new_drafter, spec_k(3, adaptive=False), trials):
        counts[tuple(out.token_ids[:3])] += 1
        assert out.token_ids[3:] == [EOS_ID]
        drafted += out.stats.draft_tokens
        accepted += out.stats.accepted_tokens
    assert set(counts) <= set(exact) and drafted > 0 and 0 < accepted < drafted
    chi2 = sum((counts[c] - trials * p) ** 2 / (trials * p) for c, p in exact.items())
    assert chi2 < chi2_critical(len(exact) - 1), (chi2, counts)


def test_prune_keeps_the_valid_prefix_and_a_final_eos(llm):
    grammar = llm.engine.grammars.matcher(Constraint("regex", "ab?"))
    a, b, c = (llm.tokenizer.encode(ch)[0] for ch in "abc")
    chain = DraftProposal(torch.tensor([a, b, c, a]), None)
    assert grammar.prune(chain).tokens.tolist() == [a, b]
    assert grammar.prune(DraftProposal(torch.tensor([a, EOS_ID, a]), None)).tokens.tolist() == [a, EOS_ID]
    assert grammar.prune(DraftProposal(torch.tensor([EOS_ID]), None)).k == 0  # "" does not match ab?
    tree = DraftProposal(torch.tensor([a, c, b, EOS_ID, a]), None, (-1, -1, 0, 0, 2))
    kept = grammar.prune(tree)
    assert kept.tokens.tolist() == [a, b, EOS_ID] and kept.parents == (-1, 0, 0)
    masks = grammar.row_masks(kept)
    assert masks.shape == (4, llm.target.config.vocab_size)
    assert masks[0].nonzero().flatten().tolist() == [a]
    assert masks[1].nonzero().flatten().tolist() == [b, EOS_ID]
    assert masks[2].nonzero().flatten().tolist() == [EOS_ID]
    assert bool(masks[3].all())  # after a drafted EOS: never committed
    assert grammar.matcher.validate_tokens([a, b]) == 2  # masking left the state where it was


def test_bad_constraints_are_named_errors(llm):
    for bad in (Constraint("regex", "[a-"), Constraint("json_schema", '{"type": "objectx"}'),
                Constraint("json_schema", "not json"), Constraint("grammar", "start: ("),
                Constraint("choice", "[]")):
        with pytest.raises(InvalidConstraintError):
            llm.generate("x", _greedy(bad))
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(constraint=Constraint("json_object"), ignore_eos=True)
    with pytest.raises(InvalidSamplingParamsError):
        Constraint("xml", "<a/>")
    with pytest.raises(InvalidSamplingParamsError):
        Constraint("regex")


def test_forced_tokens_ride_along_under_a_servers_k_cap(llm):
    """A server's K by load caps what the drafter proposes, not the tokens the grammar forces:
    those are kept for sure and cost no draft forward, so even at K = 0 they are verified as
    drafts, and the output is plain constrained decoding's."""
    from specdecode.server.k_by_load import KSchedule
    from specdecode.server.scheduler import Scheduler
    from tests.test_scheduler import _run_concurrently

    params = _greedy(CONSTRAINTS["schema"], 80)
    prompt = llm.tokenizer.encode("hi")
    plain = llm.engine.generate(prompt, params, None, spec_k(4))
    [(_, out)] = _run_concurrently(Scheduler(llm, method="ngram", max_concurrency=1,
                                             k_by_load=KSchedule.parse("1-:0")), [prompt], [params])
    assert out.token_ids == plain.token_ids and out.text.startswith('{"name": "')
    assert out.stats.target_steps < len(out.token_ids) - 8 and out.stats.drafts == 0


def test_a_constraint_beyond_the_grammar_engines_limits_is_a_named_error(llm):
    """llguidance's limits (here its 2000 items per parser row) are the user's error, named with
    the limit and a bounded message: refused by the check, and by the first step without it."""
    big = Constraint("grammar", "start: " + " | ".join(f'"{i}"' for i in range(2500)))
    with pytest.raises(InvalidConstraintError, match="limits: Parser Error: Current row has 2501 items") as refused:
        llm.engine.grammars.check(big)
    assert len(str(refused.value)) < 500
    with pytest.raises(InvalidConstraintError, match="limits"):
        llm.generate("x", _greedy(big))
    assert llm.generate("x", _greedy(CONSTRAINTS["choice"]))[0].text in {"yes", "no", "maybe"}


def test_constraints_too_big_to_compile_are_refused_before_compiling(llm):
    with pytest.raises(InvalidConstraintError, match="at most 2000 options"):
        llm.engine.grammars.check(Constraint.choice([str(i) for i in range(5000)]))
    with pytest.raises(InvalidConstraintError, match="at most 262144 are compiled"):
        llm.engine.grammars.check(Constraint("regex", "a" * 300_000))
