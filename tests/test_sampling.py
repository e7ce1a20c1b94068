"""Tests of specdecode.sample.sampling: temperature, top-k, top-p, sampling draws."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.sample import sampling
from specdecode.params import SamplingParams
from specdecode.sample.sampling import greedy, logits_to_probs, sample

NEG_INF = float("-inf")


def params(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


# ---------------------------------------------------------------- temperature

def test_temperature_one_is_softmax() -> None:
    x = logits(3, 50)
    torch.testing.assert_close(logits_to_probs(x, params(1.0)), torch.softmax(x, -1))


@pytest.mark.parametrize("t", [0.3, 0.7, 2.0, 10.0])
def test_temperature_scales_logits(t: float) -> None:
    x = logits(3, 50)
    torch.testing.assert_close(logits_to_probs(x, params(t)), torch.softmax(x / t, -1))


def test_tiny_temperature_does_not_overflow() -> None:
    x = torch.tensor([[100.0, 99.0, -50.0, 3.0]])
    probs = logits_to_probs(x, params(1e-6))
    assert torch.isfinite(probs).all()
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_temperature_zero_is_point_mass_on_argmax_lowest_id() -> None:
    x = torch.tensor([[1.0, 5.0, 5.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    probs = logits_to_probs(x, params(0.0, top_k=2, top_p=0.5))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert probs.dtype == torch.float32


# ---------------------------------------------------------------- top-k

def test_top_k_keeps_k_largest() -> None:
    x = torch.tensor([[0.1, 3.0, -1.0, 2.0, 2.5]])
    probs = logits_to_probs(x, params(top_k=2))
    expected = torch.zeros(1, 5)
    expected[0, [1, 4]] = torch.softmax(torch.tensor([3.0, 2.5]), -1)
    torch.testing.assert_close(probs, expected)


def test_top_k_ties_go_to_lowest_id() -> None:
    x = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    probs = logits_to_probs(x, params(top_k=2))
    assert (probs[0] > 0).nonzero().flatten().tolist() == [1, 2]
    torch.testing.assert_close(probs[0, 1:3], torch.tensor([0.5, 0.5]))


@pytest.mark.parametrize("k", [0, 7, 100])
def test_top_k_off_or_at_least_vocab_keeps_all(k: int) -> None:
    x = logits(2, 7)
    torch.testing.assert_close(logits_to_probs(x, params(top_k=k)), torch.softmax(x, -1))


def test_top_k_one_is_argmax() -> None:
    x = logits(4, 30)
    probs = logits_to_probs(x, params(top_k=1))
    assert torch.equal(probs, torch.nn.functional.one_hot(x.argmax(-1), 30).float())


# ---------------------------------------------------------------- top-p

def test_top_p_one_keeps_everything() -> None:
    x = logits(3, 40, scale=8.0)  # very peaked: tail tokens have tiny mass
    torch.testing.assert_close(logits_to_probs(x, params(top_p=1.0)), torch.softmax(x, -1))
    assert (logits_to_probs(x, params(top_p=1.0)) > 0).all()


def test_tiny_top_p_keeps_only_argmax() -> None:
    x = logits(5, 40)
    probs = logits_to_probs(x, params(top_p=1e-9))
    assert torch.equal(probs, torch.nn.functional.one_hot(x.argmax(-1), 40).float())


def test_top_p_smallest_set_reaching_mass() -> None:
    p = torch.tensor([0.5, 0.05, 0.3, 0.15])
    x = p.log().unsqueeze(0)
    # mass 0.5 < 0.6 -> add 0.3 -> 0.8 >= 0.6: keep {0, 2}
    probs = logits_to_probs(x, params(top_p=0.6))
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.0, 0.375, 0.0]))
    # exactly reaching top_p stops there: 0.5 >= 0.5 keeps only token 0
    assert logits_to_probs(x, params(top_p=0.5))[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    # 0.9 needs 0.5 + 0.3 + 0.15 = 0.95
    assert (logits_to_probs(x, params(top_p=0.9))[0] > 0).tolist() == [True, False, True, True]


def test_top_p_ties_go_to_lowest_id() -> None:
    x = torch.tensor([[0.0, 1.0, 1.0, 1.0]])  # three tied top tokens
    probs = logits_to_probs(x, params(top_p=0.5))  # each has ~0.3: two are needed
    assert (probs[0] > 0).tolist() == [False, True, True, False]
    tied_top = torch.tensor([[2.0, 2.0, 0.0]])
    assert logits_to_probs(tied_top, params(top_p=1e-6))[0].tolist() == [1.0, 0.0, 0.0]


def test_top_p_applies_to_top_k_renormalized() -> None:
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    x = p.log().unsqueeze(0)
    # top-k=2 -> {0.4, 0.3} renormalized to {0.571, 0.429}; top_p=0.5 keeps only token 0
    assert logits_to_probs(x, params(top_k=2, top_p=0.5))[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    # without top-k, 0.4 < 0.5 so tokens 0 and 1 are kept
    assert (logits_to_probs(x, params(top_p=0.5))[0] > 0).tolist() == [True, True, False, False]


# ---------------------------------------------------------------- general properties

FILTERS = [params(), params(0.7), params(top_k=5), params(top_p=0.9), params(1.3, 20, 0.8)]


@pytest.mark.parametrize("sp", FILTERS)
def test_rows_sum_to_one_and_no_nan_with_neg_inf(sp: SamplingParams) -> None:
    x = logits(4, 64)
    x[0, :60] = NEG_INF  # only 4 finite logits
    x[1, ::2] = NEG_INF
    x[2, 5] = NEG_INF
    probs = logits_to_probs(x, sp)
    assert probs.dtype == torch.float32
    assert not torch.isnan(probs).any()
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    assert (probs[x == NEG_INF] == 0).all()


@pytest.mark.parametrize("sp", FILTERS)
def test_input_not_modified(sp: SamplingParams) -> None:
    x = logits(3, 64)
    before = x.clone()
    logits_to_probs(x, sp)
    assert torch.equal(x, before)


@pytest.mark.parametrize("sp", FILTERS + [params(top_p=0.999)])
def test_row_result_independent_of_batch(sp: SamplingParams) -> None:
    x = logits(9, 3000, seed=3)
    batch = logits_to_probs(x, sp)
    for i in range(x.shape[0]):
        assert torch.equal(logits_to_probs(x[i : i + 1], sp), batch[i : i + 1])
    assert torch.equal(logits_to_probs(x.flip(0), sp), batch.flip(0))


@pytest.mark.parametrize("bad", [NEG_INF, float("nan"), float("inf")])
def test_bad_rows_raise(bad: float) -> None:
    x = logits(2, 8)
    x[1] = bad
    with pytest.raises(ValueError):
        logits_to_probs(x, params())


def test_bfloat16_logits_give_float32_probs() -> None:
    probs = logits_to_probs(logits(2, 16).bfloat16(), params(top_p=0.9))
    assert probs.dtype == torch.float32


# ---------------------------------------------------------------- fast path == full sort

@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(st.integers(-4, 4), min_size=2, max_size=60),
    top_k=st.integers(0, 12),
    top_p=st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.2, 1e-6]),
    candidates=st.integers(1, 8),
    temperature=st.sampled_from([0.5, 1.0, 3.0]),
)
def test_candidate_fast_path_equals_full_sort(
    data: list[int], top_k: int, top_p: float, candidates: int, temperature: float
) -> None:
    # Integer logits make ties common, the hard case for the candidate fast path.
    flat = torch.tensor(data, dtype=torch.float32).unsqueeze(0) / temperature
    top_k = top_k if top_k < flat.shape[1] else 0
    fast = sampling._keep_mask(flat, top_k, top_p, candidates)
    full = sampling._keep_mask_full_sort(flat[0], top_k, top_p)
    assert torch.equal(fast[0], full)
    kept = int(fast.sum())
    assert kept >= 1
    if top_k:
        assert kept <= top_k


def test_fast_path_matches_full_sort_on_large_vocab() -> None:
    x = logits(3, 151_936, seed=5, scale=4.0)
    for top_k, top_p in [(0, 0.9), (40, 1.0), (40, 0.7), (0, 0.999)]:
        fast = sampling._keep_mask(x, top_k, top_p, sampling._CANDIDATES)
        for i in range(3):
            assert torch.equal(fast[i], sampling._keep_mask_full_sort(x[i], top_k, top_p))


# ---------------------------------------------------------------- sample / greedy

def test_greedy_ties_lowest_id() -> None:
    x = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])
    assert greedy(x).tolist() == [1, 0]
    assert greedy(x).dtype == torch.int64


def test_sample_draws_one_uniform_per_row() -> None:
    probs = torch.softmax(logits(6, 20), -1)
    g = torch.Generator().manual_seed(11)
    out = sample(probs, g)
    assert out.shape == (6,) and out.dtype == torch.int64
    ref = torch.Generator().manual_seed(11)
    torch.rand(6, generator=ref, dtype=torch.float64)
    assert torch.equal(g.get_state(), ref.get_state())
    again = sample(probs, torch.Generator().manual_seed(11))
    assert torch.equal(out, again)


def test_inverse_cdf_edges_never_pick_zero_probability() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0]])

    def pick(u: float) -> int:
        return int(sampling._inverse_cdf(probs, torch.tensor([u], dtype=torch.float64))[0])

    assert pick(0.0) == 1
    assert pick(0.25) == 3  # exactly on the boundary goes right
    assert pick(0.2499) == 1
    assert pick(1.0 - 2**-53) == 3
    assert pick(1.0) == 3  # even a (never drawn) 1.0 stays on a positive token


def test_sample_rejects_bad_probs() -> None:
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError):
        sample(torch.zeros(1, 4), g)
    with pytest.raises(ValueError):
        sample(torch.tensor([[0.5, -0.1, 0.6]]), g)


def test_sample_matches_distribution() -> None:
    p = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.35])
    n = 40_000
    g = torch.Generator().manual_seed(1)
    draws = sample(p.expand(n, 5), g)
    counts = torch.bincount(draws, minlength=5).double()
    expected = p.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < chi2_critical(4, 0.001), chi2


def chi2_critical(dof: int, alpha: float) -> float:
    """Upper-alpha quantile of chi-square(dof), Wilson-Hilferty approximation."""
    z = _normal_upper_quantile(alpha)
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def _normal_upper_quantile(alpha: float) -> float:
    lo, hi = 0.0, 10.0
    for _ in range(100):  # bisection on the normal tail 0.5 * erfc(z / sqrt 2)
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(mid / math.sqrt(2.0)) > alpha:
            lo = mid
        else:
            hi = mid
    return lo


def test_vanishing_temperature_is_greedy():
    """1e-300 is 0 in float32: dividing logits by it would overflow, so it decodes greedily."""
    from specdecode.params import SamplingParams

    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-4).greedy
