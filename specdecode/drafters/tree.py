"""Tree drafting: several candidate continuations, verified together in one target forward.

A chain of drafts is lost at its first wrong token. A tree hedges: beside the draft model's own
chain (its argmax at each position), it offers the draft's second choice at the first few
positions, and up to ``ngram_branches`` distinct continuations copied from earlier occurrences
of the current suffix. The target scores every node in one forward (``Decoder.forward`` with a
tree) and ``sample/tree.py`` keeps the longest valid path. More nodes widen the verify call, which
on a CPU is not free (docs/PERFORMANCE.md), so the tree stays small: it pays only where the
draft's first guesses are often wrong but its second ones right.

The candidates are deterministic (argmaxes and copies) in greedy and sampling mode alike, as the
exact multi-candidate sampling rule requires. Candidates are merged into a trie, so shared
prefixes are verified once.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from specdecode.drafters.base import Drafter, Drafting, run_alone
from specdecode.sequence import EMPTY_PROPOSAL, DraftProposal, SequenceState
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter


class TokenTrie:
    """Candidate sequences merged by common prefix; nodes numbered in insertion order."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._children: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    def insert(self, sequence: list[int], limit: int) -> None:
        """Add ``sequence`` below the root, stopping once the trie has ``limit`` nodes."""
        node = -1
        for token in sequence:
            child = self._children.get((node, token))
            if child is None:
                if len(self.tokens) >= limit:
                    return
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self._children[(node, token)] = child
            node = child

    def proposal(self) -> DraftProposal:
        if not self.tokens:
            return EMPTY_PROPOSAL
        return DraftProposal(torch.tensor(self.tokens, dtype=torch.long), None, tuple(self.parents))


class TreeDrafter(Drafter):
    name: ClassVar[str] = "tree"
    draft_cost_prior: ClassVar[float] = 0.3  # the draft model's chain
    shares_forwards: ClassVar[bool] = True  # its chain is the draft model's calls

    def __init__(self, draft: DraftModelDrafter, branch_positions: int = 2, ngram_branches: int = 2,
                 max_nodes: int = 16, sibling_below: float = 0.8, ngram_min: int = 2, ngram_max: int = 4) -> None:
        """``branch_positions``: chain positions that may also get the draft's second choice (as
        a leaf), where the draft's own top choice has probability below ``sibling_below``;
        ``ngram_branches``: copied continuations added, from context matches of ``ngram_min`` to
        ``ngram_max`` tokens; ``max_nodes``: tree size cap."""
        self.sibling_below = sibling_below
        self.draft = draft
        self.ngram = NgramDrafter(ngram_min=ngram_min, ngram_max=ngram_max)
        self.branch_positions = branch_positions
        self.ngram_branches = ngram_branches
        self.max_nodes = max_nodes
        self._chain: list[int] = []
        self._committed = 0

    def begin(self, seq: SequenceState) -> None:
        self.draft.begin(seq)
        self.ngram.begin(seq)

    def finish(self, seq: SequenceState) -> None:
        self.draft.finish(seq)

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        return run_alone(self.drafting(seq, k))

    def drafting(self, seq: SequenceState, k: int) -> Drafting:
        seconds: list[int] = []

        def second_choice(logits: Tensor) -> None:  # [1, V], V: the draft head's columns
            if len(seconds) < self.branch_positions:
                top = torch.softmax(logits[0], -1).topk(2)
                # A sure draft's runner-up is rarely right: no row for it (-1: no sibling here).
                sure = float(top.values[0]) >= self.sibling_below
                seconds.append(-1 if sure else self.draft.token_id(int(top.indices[1])))

        chain = (yield from self.draft.drafting(seq, k, argmax=True, on_step=second_choice)).tokens.tolist()
        self._chain, self._committed = chain, len(seq.token_ids)
        trie = TokenTrie()
        trie.insert(chain, self.max_nodes)
        for i, alt in enumerate(seconds[: len(chain)]):
            if alt >= 0:
                trie.insert(chain[:i] + [alt], self.max_nodes)
        for copy in self.ngram.continuations(seq.token_ids, k, self.ngram_branches):
            trie.insert(copy, self.max_nodes)
        return trie.proposal()

    def catch_up(self, seq: SequenceState) -> int:
        return self.draft.catch_up(seq)

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        # The draft model cached its own chain; keep the part of it that was committed.
        committed = seq.token_ids[self._committed : self._committed + n_accepted]
        same = 0
        while same < len(committed) and same < len(self._chain) and committed[same] == self._chain[same]:
            same += 1
        self.draft.accept(seq, same)
