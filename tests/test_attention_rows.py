"""The row-wise native attention (``csrc/attention_rows.cpp``): near exact attention, every row's
bits independent of the call it is in, and the portable, AVX2 and VNNI builds equal bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.models import kernel_build

# (query heads, kv heads, head dim): groups of 6 (the 1.5B target), 7 (the 0.5B draft: blocks of 4 and 3
# with 16 registers), 8 (4 and 4), 5, 2 and 1 heads.
SHAPES = [(12, 2, 128), (14, 2, 64), (16, 2, 32), (10, 2, 64), (4, 2, 16), (8, 8, 64), (6, 1, 24)]


def _builds() -> list[tuple[str, object]]:
    """Every build this CPU runs, by name: portable, AVX2 and VNNI (whose AVX-512VL, where the
    CPU has it, gives 32 vector registers and so other blocks of keys and value lanes)."""
    return [(isa, kernel_build.load_attention(isa)) for isa in kernel_build.gguf_isas()]


def _cache(hkv: int, cap: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(hkv, cap, d, generator=g), torch.randn(hkv, cap, d, generator=g)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Float64 causal GQA: row i sees keys 0..start+i."""
    n, hq, d = q.shape
    group = hq // k.shape[0]
    out = torch.empty(n, hq, d, dtype=torch.float64)
    for i in range(n):
        for h in range(hq):
            keys, values = k[h // group, : start + i + 1].double(), v[h // group, : start + i + 1].double()
            p = torch.softmax(keys @ q[i, h].double() * scale, dim=0)
            out[i, h] = p @ values
    return out.reshape(n, hq * d)


@pytest.mark.parametrize("hq, hkv, d", SHAPES)
def test_matches_float64_attention(hq: int, hkv: int, d: int) -> None:
    k, v = _cache(hkv, 300, d, seed=hq + d)
    q = torch.randn(7, hq, d, generator=torch.Generator().manual_seed(3)) * 2
    scale = 1 / math.sqrt(d)
    want = _reference(q, k, v, 150, scale)
    for isa, build in _builds():
        got = build.attention_rows(q, k, v, 150, scale).double()
        assert (got - want).abs().max() < 2e-5, isa


@pytest.mark.parametrize("hq, hkv, d", SHAPES)
def test_rows_bitwise_invariant_and_builds_agree(hq: int, hkv: int, d: int) -> None:
    """A row's bits are those it gets alone at its slot, whatever rows share the call (a prefill
    equals token-by-token decoding), and every build gives them."""
    k, v = _cache(hkv, 64, d, seed=1)
    q = torch.randn(20, hq, d, generator=torch.Generator().manual_seed(2)) * 4
    scale = 1 / math.sqrt(d)
    results = []
    for isa, build in _builds():
        alone = torch.cat([build.attention_rows(q[i : i + 1].contiguous(), k, v, 30 + i, scale) for i in range(20)])
        for n in (1, 2, 5, 9, 16, 20):
            for first in {0, 20 - n, (20 - n) // 2}:
                got = build.attention_rows(q[first : first + n].contiguous(), k, v, 30 + first, scale)
                assert torch.equal(got, alone[first : first + n]), (isa, n, first)
        results.append(alone)
    names = [isa for isa, _ in _builds()]
    assert all(torch.equal(results[0], r) for r in results[1:]), f"the builds {names} differ"


def test_extreme_scores_stay_finite() -> None:
    """Scores far apart (exp underflow) and equal scores (uniform weights) are both handled."""
    k, v = _cache(1, 40, 8, seed=4)
    k[0, 5] = 1e3  # one key dominates completely
    q = torch.ones(1, 1, 8)
    for _, build in _builds():
        out = build.attention_rows(q, k, v, 39, 1.0)
        assert torch.isfinite(out).all() and torch.allclose(out[0], v[0, 5], atol=1e-6)
        flat = build.attention_rows(torch.zeros(1, 1, 8), k, v, 39, 1.0)  # all scores 0: the mean
        assert torch.allclose(flat[0], v[0, :40].mean(0), atol=1e-5)


@pytest.mark.parametrize("bad", ["rows past the cache", "odd head dim", "heads not grouped"])
def test_bad_shapes_are_refused(bad: str) -> None:
    _, build = _builds()[-1]
    k, v = _cache(2, 16, 16, seed=5)
    q = torch.randn(4, 4, 16)
    with pytest.raises(RuntimeError):
        if bad == "rows past the cache":
            build.attention_rows(q, k, v, 14, 0.25)
        elif bad == "odd head dim":
            build.attention_rows(torch.randn(1, 4, 12), *_cache(2, 16, 12, 6), 0, 0.25)
        else:
            build.attention_rows(torch.randn(1, 3, 16), k, v, 0, 0.25)
