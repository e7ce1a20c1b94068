"""Fixed draft lengths, early-stopping drafts and int8 drafts never change the output."""

from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.errors import InvalidConfigError
from specdecode.models.decoder import Decoder
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.models.draft_quant import linear_int8_fbgemm, pack_int8
from specdecode.sample.race import RaceKeys
from specdecode.sequence import SequenceState

PROMPTS = ["def f(x): return x + 1\ndef g(", "class A:\n    def __init__(self", "abc abc abc abd"]


@pytest.fixture(scope="module")
def tiny_llms(tiny_pair):
    target, draft = tiny_pair

    def make(**options) -> LLM:
        return LLM(model=str(target), draft=str(draft), max_seq_len=256, progress=False, **options)

    return {"default": make(), "fixed": make(adaptive=False, draft_confidence=0.0), "confident": make(draft_confidence=0.6),
            "int8": make(draft_quantize="int8"), "int4": make(draft_quantize="int4")}


@pytest.mark.parametrize("variant", ["fixed", "confident", "int8", "int4"])
def test_variants_keep_greedy_identity(tiny_llms, variant):
    llm, ref = tiny_llms[variant], tiny_llms["default"]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for prompt in PROMPTS:
        plain = ref.generate(prompt, params, method="none")[0].token_ids
        for method in ("ngram", "draft_model"):
            out = llm.generate(prompt, params, method=method, num_speculative_tokens=6)[0]
            assert out.token_ids == plain, (variant, method, prompt)


def test_confidence_threshold_shortens_drafts(tiny_llms):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    per_draft = {}
    for name in ("fixed", "confident"):
        stats = [tiny_llms[name].generate(p, params, method="draft_model", num_speculative_tokens=6)[0].stats
                 for p in PROMPTS]
        per_draft[name] = sum(s.draft_tokens for s in stats) / sum(s.drafts for s in stats)
    assert per_draft["fixed"] == 6 or per_draft["fixed"] > per_draft["confident"]
    assert per_draft["confident"] < 6


def test_int8_linear_is_close_to_float():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 32, generator=gen), torch.randn(3, 32, generator=gen)
    got, exact = linear_int8_fbgemm(x, pack_int8(w)), x @ w.T
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()


def test_int8_draft_agrees_mostly_with_float_draft(tiny_pair):
    _, draft = tiny_pair
    f32, q8 = Decoder.from_dir(draft, role="draft"), Decoder.from_dir(draft, role="draft",
                                                                              quantize="int8")
    tokens = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(1))
    a = f32.forward(tokens, f32.new_cache(64)).argmax(-1)
    b = q8.forward(tokens, q8.new_cache(64)).argmax(-1)
    assert (a == b).float().mean() > 0.8


def test_bad_draft_options(tiny_pair):
    target, draft = tiny_pair
    with pytest.raises(InvalidConfigError):
        LLM(model=str(target), draft=str(draft), draft_confidence=1.5, progress=False)
    with pytest.raises(InvalidConfigError):
        LLM(model=str(target), draft=str(draft), draft_quantize="int3", progress=False)


@pytest.mark.parametrize("draft_temperature", [0.0, 0.5])
def test_draft_temperature_keeps_the_seeded_sample(tiny_pair, draft_temperature):
    """A sampled request keeps exactly the target's sample (its race keys decide each position),
    so whatever the draft's own temperature, a seeded request gives plain sampling's tokens."""
    target, draft = tiny_pair
    llm = LLM(model=str(target), draft=str(draft), max_seq_len=256, progress=False,
              draft_temperature=draft_temperature)
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=7)
    for prompt in PROMPTS:
        plain = llm.generate(prompt, params, method="none")[0].token_ids
        for method in ("draft_model", "combined"):
            out = llm.generate(prompt, params, method=method, num_speculative_tokens=4, adaptive=False)[0]
            assert out.token_ids == plain, (draft_temperature, method, prompt)
            assert out.stats.draft_tokens > 0


def test_argmax_drafts_under_sampling(tiny_pair):
    """draft_temperature=0: the draft proposes its argmax for a sampled request, as for a greedy one."""
    target, draft = tiny_pair
    llm = LLM(model=str(target), draft=str(draft), max_seq_len=256, progress=False, draft_temperature=0.0)
    model = llm.draft_model
    drafter = DraftModelDrafter(model, llm.target.config.vocab_size, 256, temperature=0.0)
    ids = llm.tokenizer.encode(PROMPTS[0])
    sampled = SamplingParams(max_tokens=30, temperature=1.0, seed=3)
    seq = SequenceState(list(ids), len(ids), sampled, torch.Generator().manual_seed(3), None, RaceKeys(3))
    drafter.begin(seq)
    proposal = drafter.propose(seq, 5)
    greedy_seq = SequenceState(list(ids), len(ids), SamplingParams(max_tokens=30), torch.Generator(), None, None)
    reference = DraftModelDrafter(model, llm.target.config.vocab_size, 256)
    reference.begin(greedy_seq)
    assert proposal.tokens.tolist() == reference.propose(greedy_seq, 5).tokens.tolist()
    assert proposal.probs is None  # point masses: what the rejection rule needs for argmax drafts


def test_bad_draft_temperature(tiny_pair):
    target, draft = tiny_pair
    for bad in (-0.5, float("nan")):
        with pytest.raises(InvalidConfigError):
            LLM(model=str(target), draft=str(draft), draft_temperature=bad, progress=False)
