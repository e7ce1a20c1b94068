"""Losslessness on real weights: SmolLM2-135M (n-gram) and the default Qwen2.5-Coder pair.

Tiny random models cannot show near-ties of real text, where a row that rounds differently in a
verify batch than alone would flip an argmax. These tests use the converted real models from
the shared cache (converted on first use) and are marked slow; `make test` runs them.
"""

from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams

pytestmark = pytest.mark.slow

SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "List three colors: red, green,",
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\n\nx = np.arange(10)\nprint(x",
    "Q: What is 12 times 12?\nA:",
]
PAIR_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize in one sentence: speculative decoding lets a small model draft tokens that a "
    "large model verifies in one pass, which keeps the output identical while saving time.",
]


@pytest.fixture(scope="module")
def smol(real_home):
    return LLM(model="smollm2-135m-instruct", max_seq_len=1024, progress=False)


def _transformers_logits(ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from specdecode.models.catalog import resolve_model
    from specdecode.models.gguf_convert import write_float_weights

    folder = resolve_model("smollm2-135m-instruct")
    write_float_weights(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return ref(ids[None]).logits[0]


def test_smollm2_logits_match_transformers(real_home):
    smol_float = LLM(model="smollm2-135m-instruct", max_seq_len=1024, progress=False, quantize="none")
    ids = torch.tensor(smol_float.tokenizer.encode(SMOL_PROMPTS[1]))
    got = smol_float.target.forward(ids, smol_float.target.new_cache(len(ids)))
    torch.testing.assert_close(got, _transformers_logits(ids), atol=1e-3, rtol=1e-4)


def test_smollm2_native_logits_near_transformers(smol, real_home):
    """The GGUF run as shipped (the default) against transformers on its dequantized weights: only
    the activations' int8 rounding separates them (SmolLM2 is a llama file: q/k rows permuted)."""
    assert smol.quantize == "native"
    ids = torch.tensor(smol.tokenizer.encode(SMOL_PROMPTS[1]))
    got = smol.target.forward(ids, smol.target.new_cache(len(ids)))
    want = _transformers_logits(ids)
    assert (got - want).norm() / want.norm() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.fixture(scope="module")
def smol_plain(smol):
    return {p: smol.generate(p, SamplingParams(max_tokens=48, temperature=0.0), method="none")[0] for p in SMOL_PROMPTS}


@pytest.mark.parametrize("k", [1, 4, 8])  # the policy chooses the Ks between them
def test_smollm2_ngram_greedy_identity(smol, smol_plain, k):
    params = SamplingParams(max_tokens=48, temperature=0.0)
    accepted = 0
    for prompt, plain in smol_plain.items():
        spec = smol.generate(prompt, params, method="ngram", num_speculative_tokens=k)[0]
        assert spec.token_ids == plain.token_ids, prompt
        accepted += spec.stats.accepted_tokens
    assert accepted > 0


def test_smollm2_knows_paris(smol):
    out = smol.generate("The capital of France is", SamplingParams(max_tokens=4))[0]
    assert "Paris" in out.text


@pytest.fixture(scope="module")
def pair(real_home):
    return LLM(model="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", max_seq_len=1024,
               progress=False)


@pytest.fixture(scope="module")
def pair_plain(pair):
    params = SamplingParams(max_tokens=32, temperature=0.0)
    return {p: pair.chat([{"role": "user", "content": p}], params, method="none") for p in PAIR_PROMPTS}


@pytest.mark.parametrize("k", [1, 4, 8])  # the policy chooses the Ks between them
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_default_pair_greedy_identity(pair, pair_plain, method, k):
    params = SamplingParams(max_tokens=32, temperature=0.0)
    for prompt, plain in pair_plain.items():
        spec = pair.chat([{"role": "user", "content": prompt}], params, method=method, num_speculative_tokens=k)
        assert spec.token_ids == plain.token_ids, (method, k, prompt)
        assert spec.text == plain.text
    if method == "draft_model":  # at a fixed K (the policy may rightly not draft on this CPU)
        fixed = pair.chat([{"role": "user", "content": prompt}], params, method=method, num_speculative_tokens=k,
                          adaptive=False)
        assert fixed.token_ids == plain.token_ids
        assert fixed.stats.mean_acceptance_length > 1.5  # the real pair agrees on most tokens
