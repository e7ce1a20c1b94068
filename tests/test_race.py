"""Race keys (``sample/race.py``): Exp(1) draws fixed by a request's seed and a position, whose
race picks each token with exactly its probability."""

from __future__ import annotations

import math

import torch

from specdecode.sample import race as race_module
from specdecode.sample.race import RaceKeys, exponential_keys, race

KS_CRITICAL = 1.95  # Kolmogorov-Smirnov: sqrt(n) * D above this has probability 0.001


def test_keys_are_exponential_and_independent_across_positions() -> None:
    keys = RaceKeys(seed=11)
    draws = torch.stack([keys.at(position, 500) for position in range(400)])  # 200,000 keys
    values = draws.flatten().double().sort().values
    n = values.numel()
    cdf = 1 - torch.exp(-values)
    empirical = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = max(float((empirical - cdf).abs().max()), float((cdf - (empirical - 1 / n)).abs().max()))
    assert math.sqrt(n) * ks < KS_CRITICAL
    # neighbouring positions and tokens are uncorrelated (|r| < 4.5 sigma of 199,500 pairs)
    a, b = draws[:-1].flatten(), draws[1:].flatten()
    r = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    assert abs(r) < 4.5 / math.sqrt(a.numel())


def test_keys_are_a_function_of_seed_and_position() -> None:
    first, again, other_seed = RaceKeys(3), RaceKeys(3), RaceKeys(4)
    assert torch.equal(first.at(7, 1000), again.at(7, 1000))
    assert not torch.equal(first.at(7, 1000), first.at(8, 1000))
    assert not torch.equal(first.at(7, 1000), other_seed.at(7, 1000))
    first.forget_before(8)  # forgotten keys come back the same
    assert torch.equal(first.at(7, 1000), again.at(7, 1000))


def test_the_race_picks_each_token_with_its_probability() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    keys = RaceKeys(seed=5)
    trials = 20000
    wins = torch.bincount(torch.stack([race(probs, keys.at(t, 5)) for t in range(trials)]), minlength=5)
    assert wins[4] == 0  # a token of probability 0 never wins
    expected = probs[:4] * trials
    chi2 = float(((wins[:4] - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001


def test_a_zero_draw_gives_an_infinite_key_that_never_wins(monkeypatch) -> None:
    """-log U, not -log(1 - U): a uniform draw of 0 must make the token lose, not win."""
    monkeypatch.setattr(race_module.torch, "rand", lambda n, generator: torch.tensor([0.0, 0.5, 0.9])[:n])
    keys = exponential_keys(torch.Generator(), 3)
    assert math.isinf(float(keys[0])) and math.isclose(float(keys[1]), -math.log(0.5), rel_tol=1e-6)
    assert int(race(torch.tensor([0.98, 0.01, 0.01]), keys)) != 0
