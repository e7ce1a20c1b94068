"""The native whole forward of a GGUF target (``GGUFForward``) gives every row the bits its Python
layers give it, alone or in a batch of sequences, in every kernel build and with any number of
threads: so plain decoding, a verify step, a server batch and a token tree, which take one path or
the other by their shapes, stay token-identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.models import gguf_forward, kernel_build
from specdecode.models.decoder import Decoder
from specdecode.models.weights import DecoderWeights
from tests.gguf_blocks import write_model_gguf

# Layers of different types for the same matrix (as a Q4_K_M file's ffn_down and attn_v), and
# every block family: the native forward's activations must serve each layer's tiles.
TYPES = {"blk.0.ffn_down": "Q6_K", "blk.1.attn_v": "Q4_K", "attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K",
         "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q4_0", "token_embd": "Q8_0",
         "output.weight": "Q6_K"}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Decoder:
    path = Path(tmp_path_factory.mktemp("fused")) / "target.gguf"
    write_model_gguf(path, TYPES, layers=3, seed=5)
    return LLM(model=str(path), max_seq_len=128, progress=False).target


def _step(model: Decoder, prompt: torch.Tensor, rows: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits of ``rows`` after ``prompt`` (prefilled through the layers), and the cache's keys and values."""
    cache = model.new_cache(64)
    model.forward_batch([(prompt, cache)])
    logits = model.forward(rows, cache, **kw)
    return logits, cache.k[:, :, : cache.length].clone(), cache.v[:, :, : cache.length].clone()


def test_gguf_target_has_a_native_forward(target: Decoder) -> None:
    assert target.backend.fused is not None and target.backend.fused_rows == gguf_forward.FUSED_MAX_ROWS
    assert target.backend.layered().fused is None


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 15])
def test_native_forward_matches_the_layers_bitwise(target: Decoder, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    prompt, new = torch.randint(0, 200, (11,), generator=g), torch.randint(0, 200, (rows,), generator=g)
    layered = target.with_backend(target.backend.layered())
    want = _step(layered, prompt, new)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            got = _step(target, prompt, new)
        finally:
            torch.set_num_threads(2)
        for a, b in zip(got, want):
            assert torch.equal(a, b), threads
    last = _step(target, prompt, new, last_only=True)[0]
    assert torch.equal(last, want[0][-1:])


@pytest.mark.parametrize("last_only", [False, True])
def test_native_batch_matches_the_layers_bitwise(target: Decoder, last_only: bool) -> None:
    """A server's batch: sequences of different lengths and row counts, each in its own cache."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 200, (n,), generator=g) for n in (3, 12, 7)]
    rows = [torch.randint(0, 200, (n,), generator=g) for n in (1, 5, 2)]
    results = []
    for model in (target, target.with_backend(target.backend.layered())):
        caches = [model.new_cache(64) for _ in prompts]
        for p, c in zip(prompts, caches):
            model.forward_batch([(p, c)])
        logits = model.forward_batch(list(zip(rows, caches)), last_only=last_only)
        results.append((logits, [c.k[:, :, : c.length].clone() for c in caches], [c.v[:, :, : c.length].clone() for c in caches]))
    (got, got_k, got_v), (want, want_k, want_v) = results
    assert [x.shape[0] for x in got] == ([1, 1, 1] if last_only else [1, 5, 2])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(got_k + got_v, want_k + want_v))


def test_every_build_gives_the_same_bits(target: Decoder) -> None:
    prompt, new = torch.arange(3, 10), torch.tensor([7, 1, 4, 4])
    weights = DecoderWeights(target.dtype, target.embed, target.lm_head, target.norm, target.layers, target.cos, target.sin)
    results = []
    for isa in kernel_build.gguf_isas():
        fused = gguf_forward.fused_gguf(target.config, weights, isa)
        cache = target.new_cache(32)
        target.forward_batch([(prompt, cache)])
        start = cache.reserve(len(new))
        results.append(fused.forward(target.embed_tokens(new), cache.k, cache.v, start, False))
        assert fused.forward(target.embed_tokens(new), cache.k, cache.v, start, True, False).shape[0] == 0  # no head asked
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_longer_calls_take_the_layers(target: Decoder, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    fused = target.backend.fused

    class Counting:
        def forward(self, *args, **kwargs):
            calls.append(args[0].shape[0])
            return fused.forward(*args, **kwargs)

        def forward_batch(self, *args, **kwargs):
            calls.append(("batch", args[0].shape[0]))
            return fused.forward_batch(*args, **kwargs)

    monkeypatch.setattr(target.backend, "fused", Counting())
    cache = target.new_cache(64)
    target.forward(torch.arange(20), cache)  # a prompt: the layers' wide tiles
    target.forward(torch.arange(3), cache, invariant=True)  # the native forward is invariant itself
    other = target.new_cache(64)
    target.forward_batch([(torch.arange(2), cache), (torch.arange(20), other)])  # a prompt in the batch: the layers
    target.forward_batch([(torch.arange(2), cache), (torch.arange(4), other)])  # decode rows: native
    target.forward_batch([(torch.arange(2), cache), (torch.arange(3), other)], trees=[None, [-1, 0, 0]])  # a tree: layers
    assert calls == [3, ("batch", 6)]


def test_bad_calls_are_refused(target: Decoder) -> None:
    fused, cache = target.backend.fused, target.new_cache(8)
    with pytest.raises(RuntimeError, match="past the cache"):
        fused.forward(target.embed_tokens(torch.tensor([1, 2])), cache.k, cache.v, cache.capacity - 1, False)
    with pytest.raises(RuntimeError, match="hidden"):
        fused.forward(torch.zeros(1, 3), cache.k, cache.v, 0, False)


def test_greedy_identity_across_paths(tmp_path: Path) -> None:
    """Plain decoding (native forward, one row) against speculation whose verify steps take the
    native forward and a tree method whose steps take the layers."""
    path, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    write_model_gguf(path, TYPES, layers=2, seed=7)
    write_model_gguf(draft, {"": "Q8_0"}, layers=1, seed=7)
    llm = LLM(model=str(path), draft=str(draft), max_seq_len=256, progress=False)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompt = "def add(a, b): return a + b\n" * 2
    plain = llm.generate(prompt, params, method="none")[0].token_ids
    for method in ("ngram", "draft_model", "tree"):
        assert llm.generate(prompt, params, method=method, num_speculative_tokens=4, adaptive=False)[0].token_ids == plain
