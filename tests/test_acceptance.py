"""Acceptance of draft tokens: greedy acceptance and exact (lossless) rejection sampling of
specdecode.sample.chain, and the one entry point, specdecode.sample.verify.verify.

The key tests simulate the whole draft -> verify -> commit loop on a tiny vocabulary with an
autoregressive target (a first-order Markov chain: row i of the target depends on the token
before it) and compare the emitted tokens' histograms with the exact target distribution by a
chi-square test.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.sample.chain import _residual, verify_greedy, verify_rejection
from specdecode.sequence import VerifyResult

V = 6  # vocabulary of the simulations
K = 3  # draft length of the simulations
BOS = V  # context row used for the first token
TRIALS = 10_000  # twice the 5,000 at which the harness already fails a lossy rule (test_chi2_detects_a_lossy_rule)


# ---------------------------------------------------------------- chi-square helpers

def chi2_critical(dof: int, alpha: float = 0.001) -> float:
    """Upper-alpha quantile of chi-square(dof), Wilson-Hilferty approximation."""
    lo, hi = 0.0, 10.0
    for _ in range(100):  # normal upper quantile by bisection on 0.5 * erfc(z / sqrt 2)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * math.erfc(mid / math.sqrt(2.0)) > alpha else (lo, mid)
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + lo * math.sqrt(a)) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; cells expecting < 5 are pooled into one."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().unsqueeze(0)])
    exp = torch.cat([expected[~small], expected[small].sum().unsqueeze(0)])
    if exp[-1] == 0:
        assert obs[-1] == 0, "a token with target probability 0 was emitted"
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), obs.numel() - 1


def test_chi2_critical_matches_table() -> None:
    # chi-square upper 0.001 quantiles: dof 5 -> 20.515, dof 35 -> 66.619
    assert chi2_critical(5) == pytest.approx(20.515, rel=0.02)
    assert chi2_critical(35) == pytest.approx(66.619, rel=0.005)


# ---------------------------------------------------------------- the simulated process

def markov_table(seed: int, sharpness: float) -> torch.Tensor:
    """[V + 1, V]: row c is the next-token distribution after token c (row BOS: first token)."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V + 1, V, generator=g, dtype=torch.float64) * sharpness, -1).float()


def perturbed(table: torch.Tensor, seed: int, noise: float) -> torch.Tensor:
    """A drafter that resembles the target but clearly differs (total variation ~0.3)."""
    g = torch.Generator().manual_seed(seed)
    logits = table.double().log() + torch.randn(table.shape, generator=g, dtype=torch.float64) * noise
    return torch.softmax(logits, -1).float()


TARGET = markov_table(seed=1, sharpness=1.0)
DRAFT = perturbed(TARGET, seed=2, noise=1.0)


def deterministic_draft(prev: int) -> int:
    """An "n-gram" drafter: the target's favourite after even tokens, a fixed guess otherwise."""
    return int(TARGET[prev].argmax()) if prev % 2 == 0 else (3 * prev + 1) % V


@dataclass
class Simulation:
    pairs: torch.Tensor  # [V, V] counts of the first two emitted tokens
    first_step_accepted: torch.Tensor  # [TRIALS] 1 if the first draft token was accepted
    accepted: int
    drafted: int


Verifier = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator], VerifyResult]


def simulate(draft: torch.Tensor | None, seed: int, verifier: Verifier = verify_rejection,
             trials: int = TRIALS) -> Simulation:
    """Run draft -> verify until two tokens are emitted, ``trials`` times.

    draft: a [V + 1, V] Markov table to sample drafts from, or None for the deterministic
    drafter. Drafts and verification share one generator, as in the engine.
    """
    g = torch.Generator().manual_seed(seed)
    cdfs = None if draft is None else draft.double().cumsum(-1).tolist()
    pairs = torch.zeros(V, V, dtype=torch.int64)
    first = torch.zeros(trials, dtype=torch.int64)
    accepted = drafted = 0
    for trial in range(trials):
        out: list[int] = []
        prev = BOS
        while len(out) < 2:
            ctx = [prev]
            if cdfs is None:
                for _ in range(K):
                    ctx.append(deterministic_draft(ctx[-1]))
            else:
                for u in torch.rand(K, generator=g, dtype=torch.float64).tolist():
                    row = cdfs[ctx[-1]]
                    ctx.append(min(bisect.bisect_right(row, u * row[-1]), V - 1))
            tokens = torch.tensor(ctx[1:])
            target_probs = TARGET[ctx]  # [K + 1, V]; row i conditioned on the token before it
            draft_probs = None if draft is None else draft[ctx[:K]]  # [K, V]
            res = verifier(tokens, draft_probs, target_probs, g)
            assert len(res.tokens) == res.num_accepted + 1
            assert res.tokens[: res.num_accepted] == ctx[1 : res.num_accepted + 1]
            if not out:
                first[trial] = int(res.num_accepted > 0)
            accepted += res.num_accepted
            drafted += K
            out += res.tokens
            prev = out[-1]
        pairs[out[0], out[1]] += 1
    return Simulation(pairs, first, accepted, drafted)


def exact_pairs() -> torch.Tensor:
    """[V, V] exact target probability of emitting (t0, t1) first: p(t0) * p(t1 | t0)."""
    return TARGET[BOS].double().unsqueeze(1) * TARGET[:V].double()


@pytest.fixture(scope="module")
def sim_sampled_draft() -> Simulation:
    return simulate(DRAFT, seed=10)


@pytest.fixture(scope="module")
def sim_deterministic_draft() -> Simulation:
    return simulate(None, seed=11)


def assert_matches_target(sim: Simulation) -> None:
    first_counts = sim.pairs.sum(1)
    stat, dof = chi2_stat(first_counts, TARGET[BOS])
    assert stat < chi2_critical(dof), f"first token: chi2 {stat:.1f} with {dof} dof"
    stat, dof = chi2_stat(sim.pairs, exact_pairs())
    assert stat < chi2_critical(dof), f"first two tokens: chi2 {stat:.1f} with {dof} dof"


# ---------------------------------------------------------------- losslessness

def test_lossless_with_sampled_draft(sim_sampled_draft: Simulation) -> None:
    assert_matches_target(sim_sampled_draft)


def test_lossless_with_deterministic_draft(sim_deterministic_draft: Simulation) -> None:
    assert_matches_target(sim_deterministic_draft)


def test_draft_equal_to_target_accepts_everything() -> None:
    sim = simulate(TARGET, seed=12, trials=5_000)
    assert sim.accepted == sim.drafted
    assert_matches_target(sim)


def test_acceptance_rate_matches_theory(sim_sampled_draft: Simulation) -> None:
    # The first draft token of a trial is drawn from q = DRAFT[BOS] and judged against
    # p = TARGET[BOS]: accepted with probability sum_x min(p(x), q(x)).
    alpha = float(torch.minimum(TARGET[BOS], DRAFT[BOS]).sum())
    measured = sim_sampled_draft.first_step_accepted.double().mean().item()
    se = math.sqrt(alpha * (1 - alpha) / TRIALS)
    assert abs(measured - alpha) < 5 * se, (measured, alpha)
    assert 0.2 < alpha < 0.9  # the drafter is clearly different from the target
    assert 0.3 < 1 - sim_sampled_draft.accepted / sim_sampled_draft.drafted < 0.7  # many rejections


def test_acceptance_rate_deterministic_draft(sim_deterministic_draft: Simulation) -> None:
    alpha = float(TARGET[BOS, deterministic_draft(BOS)])  # q is a point mass: accept w.p. p(x)
    measured = sim_deterministic_draft.first_step_accepted.double().mean().item()
    assert abs(measured - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / TRIALS), (measured, alpha)


def lossy_verifier(tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                   g: torch.Generator) -> VerifyResult:
    """A classic bug: on rejection, resample from p instead of norm(max(0, p - q))."""
    res = verify_rejection(tokens, q, p, g)
    if res.num_accepted == tokens.shape[0]:
        return res
    extra = int(torch.multinomial(p[res.num_accepted], 1, generator=g))
    return VerifyResult(res.num_accepted, res.tokens[:-1] + [extra])


def test_chi2_detects_a_lossy_rule() -> None:
    # Power check of the harness: the same test must fail for a subtly wrong rule.
    sim = simulate(DRAFT, seed=13, verifier=lossy_verifier, trials=5_000)
    stat, dof = chi2_stat(sim.pairs.sum(1), TARGET[BOS])
    assert stat > chi2_critical(dof), stat


# ---------------------------------------------------------------- verify_greedy

def test_greedy_all_accepted_gives_bonus() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 4.0]])
    res = verify_greedy(torch.tensor([1, 0]), logits)
    assert res == VerifyResult(2, [1, 0, 2])


@pytest.mark.parametrize("i", [0, 1, 2, 3])
def test_greedy_rejects_at_position(i: int) -> None:
    g = torch.Generator().manual_seed(i)
    logits = torch.randn(5, 10, generator=g)
    argmax = logits.argmax(-1)
    draft = argmax[:4].clone()
    draft[i] = (draft[i] + 1) % 10
    res = verify_greedy(draft, logits)
    assert res.num_accepted == i
    assert res.tokens == argmax[: i + 1].tolist()


def test_greedy_k1_and_k0() -> None:
    logits = torch.tensor([[0.0, 2.0], [2.0, 0.0]])
    assert verify_greedy(torch.tensor([1]), logits) == VerifyResult(1, [1, 0])
    assert verify_greedy(torch.tensor([0]), logits) == VerifyResult(0, [1])
    assert verify_greedy(torch.tensor([], dtype=torch.int64), logits[:1]) == VerifyResult(0, [1])


def test_greedy_ties_lowest_id() -> None:
    logits = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0]])
    assert verify_greedy(torch.tensor([1]), logits) == VerifyResult(0, [0])
    assert verify_greedy(torch.tensor([0]), logits) == VerifyResult(1, [0, 1])


@settings(max_examples=100, deadline=None)
@given(k=st.integers(0, 8), vocab=st.integers(2, 12), seed=st.integers(0, 2**31 - 1),
       agree=st.integers(0, 8))
def test_greedy_equals_argmax_chain(k: int, vocab: int, seed: int, agree: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (k + 1, vocab), generator=g).float()  # ties are common
    draft = torch.randint(0, vocab, (k,), generator=g)
    draft[: min(agree, k)] = logits[: min(agree, k)].argmax(-1)
    expected: list[int] = []
    for i in range(k + 1):  # plain greedy decoding, one token at a time
        best = int(logits[i].argmax())
        expected.append(best)
        if i == k or int(draft[i]) != best:
            break
    res = verify_greedy(draft, logits)
    assert res.tokens == expected
    assert res.num_accepted == len(expected) - 1


# ---------------------------------------------------------------- verify_rejection properties

def random_probs(g: torch.Generator, rows: int, vocab: int, sparse: bool) -> torch.Tensor:
    w = torch.rand(rows, vocab, generator=g)
    if sparse:
        w = w * (torch.rand(rows, vocab, generator=g) < 0.5)
        w[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=g)] += 0.1
    return w / w.sum(-1, keepdim=True)


@settings(max_examples=150, deadline=None)
@given(k=st.integers(0, 6), vocab=st.integers(2, 10), seed=st.integers(0, 2**31 - 1),
       deterministic=st.booleans(), sparse=st.booleans())
def test_rejection_invariants(
    k: int, vocab: int, seed: int, deterministic: bool, sparse: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    p = random_probs(g, k + 1, vocab, sparse)
    q = None if deterministic else random_probs(g, k, vocab, sparse)
    if q is None or k == 0:
        draft = torch.randint(0, vocab, (k,), generator=g)
    else:  # a sampled draft token always has q > 0
        draft = torch.multinomial(q, 1, generator=g).flatten()
    state = g.get_state()
    res = verify_rejection(draft, q, p, g)
    assert 0 <= res.num_accepted <= k
    assert len(res.tokens) == res.num_accepted + 1
    assert res.tokens[: res.num_accepted] == draft[: res.num_accepted].tolist()
    for i, t in enumerate(res.tokens):  # nothing the target rules out is ever emitted
        assert p[i, t] > 0
    if res.num_accepted < k:  # the recovered token is never the rejected one when q is a point mass
        if q is None:
            assert res.tokens[-1] != int(draft[res.num_accepted])
    # Exactly K + 1 float64 uniforms were drawn, whatever happened.
    ref = torch.Generator()
    ref.set_state(state)
    torch.rand(k, generator=ref, dtype=torch.float64)
    torch.rand(1, generator=ref, dtype=torch.float64)
    assert torch.equal(g.get_state(), ref.get_state())
    # Reproducible from the generator state.
    again = torch.Generator()
    again.set_state(state)
    assert verify_rejection(draft, q, p, again) == res


@settings(max_examples=100, deadline=None)
@given(k=st.integers(0, 6), vocab=st.integers(2, 10), seed=st.integers(0, 2**31 - 1),
       deterministic=st.booleans())
def test_rejection_with_one_hot_target_is_greedy(
    k: int, vocab: int, seed: int, deterministic: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, vocab, generator=g)
    p = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()  # temperature 0
    q = None if deterministic else random_probs(g, k, vocab, sparse=False)
    draft = torch.randint(0, vocab, (k,), generator=g)
    draft[: k // 2] = logits[: k // 2].argmax(-1)
    assert verify_rejection(draft, q, p, g) == verify_greedy(draft, logits)


def test_rejection_always_rejects_token_target_rules_out() -> None:
    p = torch.tensor([[0.0, 0.4, 0.6], [1.0, 0.0, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    for seed in range(20):
        res = verify_rejection(torch.tensor([0]), q, p, torch.Generator().manual_seed(seed))
        assert res.num_accepted == 0 and res.tokens[0] in (1, 2)


def test_residual_falls_back_to_target_when_empty() -> None:
    p = torch.tensor([0.25, 0.25, 0.5])
    q = torch.tensor([0.25, 0.25 + 1e-8, 0.5])  # p - q <= 0 everywhere: zero residual mass
    assert torch.equal(_residual(p, q, 1), p.double())
    assert torch.equal(_residual(p, torch.zeros(3), 1), p.double())
    # a rejection with an empty residual still emits a token the target allows
    p2 = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    q2 = torch.tensor([[0.2, 0.5, 0.5]])
    res = verify_rejection(torch.tensor([0]), q2, p2, torch.Generator().manual_seed(0))
    assert res.num_accepted == 0 and res.tokens[0] in (1, 2)


def test_point_mass_residual_removes_draft_token() -> None:
    p = torch.tensor([0.2, 0.3, 0.5])
    assert _residual(p, None, 2).tolist() == pytest.approx([0.2, 0.3, 0.0])


@pytest.mark.parametrize(
    ("draft", "q", "p"),
    [
        (torch.tensor([[0, 1]]), None, torch.rand(3, 4)),  # draft not 1-D
        (torch.tensor([0, 1]), None, torch.rand(2, 4)),  # target rows != K + 1
        (torch.tensor([0, 1]), torch.rand(2, 5), torch.rand(3, 4)),  # vocab mismatch
        (torch.tensor([0, 1]), torch.rand(1, 4), torch.rand(3, 4)),  # draft rows != K
    ],
)
def test_shape_errors(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        verify_rejection(draft, q, p, torch.Generator().manual_seed(0))


def test_greedy_shape_error() -> None:
    with pytest.raises(ValueError):
        verify_greedy(torch.tensor([0, 1]), torch.rand(2, 4))


def test_verify_result_is_frozen() -> None:
    res = VerifyResult(0, [1])
    with pytest.raises(AttributeError):
        res.num_accepted = 1  # type: ignore[misc]


# ---------------------------------------------------------------- the one entry point


def test_verify_dispatches_chain_and_tree_greedy_and_sampled():
    from specdecode.sample.verify import verify
    from specdecode.params import SamplingParams
    from specdecode.sequence import DraftProposal
    from specdecode.sample.sampling import logits_to_probs
    from specdecode.sample.tree import verify_tree_greedy

    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [0.0, 1.0, 6.0]])
    chain = DraftProposal(torch.tensor([1, 0]), None)
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    assert verify(chain, logits, greedy) == verify_greedy(chain.tokens, logits)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    want = verify_rejection(chain.tokens, None, logits_to_probs(logits, sampled), g2)
    got = verify(chain, logits, sampled, generator=g1)
    assert got == want and got.rows is None
    keys = torch.empty(3, 3).exponential_(generator=torch.Generator().manual_seed(5))
    raced = verify(chain, logits, sampled, keys)  # sampled with race keys: greedy on p / E
    assert raced == verify_greedy(chain.tokens, logits_to_probs(logits, sampled) / keys)
    tree = DraftProposal(torch.tensor([2, 1]), None, parents=(-1, -1))  # two first-token candidates
    result = verify(tree, logits, greedy)
    assert result == verify_tree_greedy(tree.tokens, tree.parents, logits) and result.rows == [0, 2]
