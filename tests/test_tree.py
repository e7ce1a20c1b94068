"""Token trees: the tree forward gives every branch the bits of a chain, the tree rules are exact,
and the cache keeps exactly the accepted path."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specdecode.sequence import DraftProposal
from specdecode.drafters.tree import TokenTrie
from specdecode.models.decoder import Decoder
from specdecode.sample.tree import children_by_row, verify_tree_greedy, verify_tree_rejection
from tests.test_sampling_lossless import chi2_critical

# Rows: 0 root; nodes 0..5 are rows 1..6. Branches: 0-1 (rows 1,2), 2-3-4 (rows 3,4,5), 0-5 (rows 1,6).
PARENTS = (-1, 0, -1, 2, 3, 0)
TOKENS = torch.tensor([5, 7, 9, 11, 13, 17])
ROW_TREE = [-1] + [p + 1 for p in PARENTS]


@pytest.fixture(scope="module")
def model(tiny_pair) -> Decoder:
    return Decoder.from_dir(tiny_pair[0])


def _prefilled(model: Decoder, prompt: torch.Tensor):
    cache = model.new_cache(200)
    model.forward(prompt, cache)
    return cache


def test_every_branch_gets_the_bits_of_its_chain(model):
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(1))
    inputs = torch.cat([torch.tensor([3]), TOKENS])
    tree_logits = model.forward(inputs, _prefilled(model, prompt), tree=ROW_TREE)
    for rows in ([0, 1, 2], [0, 3, 4, 5], [0, 1, 6]):
        chain = model.forward(inputs[rows], _prefilled(model, prompt))
        assert torch.equal(chain, tree_logits[rows]), rows
        cache = _prefilled(model, prompt)  # and of plain one-token decoding
        single = torch.cat([model.forward(inputs[r : r + 1], cache) for r in rows])
        assert torch.equal(single, tree_logits[rows]), rows


def test_keep_rows_leaves_the_cache_of_the_accepted_path(model):
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(2))
    inputs = torch.cat([torch.tensor([3]), TOKENS])
    cache = _prefilled(model, prompt)
    model.forward(inputs, cache, tree=ROW_TREE)
    cache.keep_rows([0, 3, 4])
    assert cache.length == 30 + 3
    after = model.forward(torch.tensor([42, 43]), cache)
    reference = model.forward(torch.tensor([3, 9, 11, 42, 43]), _prefilled(model, prompt))[-2:]
    assert torch.equal(after, reference)


def test_greedy_follows_the_argmax_through_the_tree():
    vocab = 20
    logits = torch.zeros(len(PARENTS) + 1, vocab)
    logits[0, 9] = 1  # root: node 2 (token 9) matches, node 0 (token 5) does not
    logits[3, 11] = 1  # row of node 2: its child node 3 (11) matches
    logits[4, 4] = 1  # row of node 3: the target wants 4, node 4 has 13: recovered token 4
    result = verify_tree_greedy(TOKENS, PARENTS, logits)
    assert (result.num_accepted, result.tokens, result.rows) == (2, [9, 11, 4], [0, 3, 4])
    logits[4, 13] = 2  # now node 4 matches too, and its leaf row gives the bonus token
    logits[5, 1] = 1
    result = verify_tree_greedy(TOKENS, PARENTS, logits)
    assert (result.num_accepted, result.tokens, result.rows) == (3, [9, 11, 13, 1], [0, 3, 4, 5])


def test_rejection_sampling_over_siblings_keeps_the_target_law():
    """First emitted token ~ p exactly, whatever the candidates (including a repeated one)."""
    p = torch.tensor([0.05, 0.3, 0.25, 0.15, 0.25])
    probs = p.repeat(4, 1)  # [K + 1, V]
    tokens, parents = torch.tensor([1, 2, 1]), (-1, -1, -1)  # siblings 1, 2 and 1 again
    gen = torch.Generator().manual_seed(0)
    trials = 20000
    counts = Counter(verify_tree_rejection(tokens, parents, probs, gen).tokens[0] for _ in range(trials))
    stat = sum((counts[t] - trials * float(p[t])) ** 2 / (trials * float(p[t])) for t in range(5))
    assert stat < chi2_critical(4), (counts, stat)


def test_bad_trees_are_refused():
    with pytest.raises(ValueError):
        DraftProposal(torch.tensor([1, 2]), None, (0, -1))  # a parent after its child
    with pytest.raises(ValueError):
        DraftProposal(torch.tensor([1]), torch.ones(1, 4) / 4, (-1,))  # trees are deterministic
    with pytest.raises(ValueError):
        verify_tree_greedy(torch.tensor([1, 2]), (-1,), torch.zeros(3, 4))


def test_trie_merges_shared_prefixes_and_respects_its_limit():
    trie = TokenTrie()
    trie.insert([1, 2, 3], limit=5)
    trie.insert([1, 2, 4], limit=5)
    trie.insert([7, 8, 9], limit=5)
    assert trie.tokens == [1, 2, 3, 4, 7]
    assert trie.parents == [-1, 0, 1, 1, -1]
    proposal = trie.proposal()
    assert proposal.is_tree and proposal.depth == 3 and proposal.k == 5
    assert children_by_row(proposal.parents) == [[0, 4], [1], [2, 3], [], [], []]
    assert proposal.truncated(3).parents == (-1, 0, 1) and not proposal.truncated(3).is_tree

