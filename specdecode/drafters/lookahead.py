"""Lookahead decoding (Fu et al. 2024): Jacobi iterations make n-grams, the same forward checks them.

No draft model and no datastore: the target itself guesses. The drafter keeps a window of
``window`` columns and up to ``ngram - 1`` levels of guessed tokens; level l, column j guesses the
token at l + j + 1 positions after the last committed one. Every step sends, in one target
forward, two branches of a token tree (``Decoder.forward`` with a tree):

- the lookahead branch: every window token, whose row sees the committed context, level 0 up to
  its column and its own column's earlier levels (the Jacobi trajectory of that position). The
  target's argmax at the last level's rows is a new level; each column then yields an n-gram of
  ``ngram`` consecutive guesses, added to a pool keyed by its first token; the oldest level drops.
- the verification branch: up to ``candidates`` n-grams from the pool whose first token is the
  last committed token, each a chain of ``ngram - 1`` drafts.

Both branches are ordinary tree nodes, so a window path that happens to be right is accepted too.
Exactness never depends on the guesses: ``sample/tree.py`` keeps only what the target agrees with,
and every guess is deterministic (argmaxes and copies), as exact multi-candidate sampling needs.
The pool also starts with the prompt's n-grams, so text the answer repeats is found at once.

On this CPU a verify row is not free (docs/PERFORMANCE.md), so the defaults keep the tree small:
4 columns, 3-grams (2 levels) and 3 candidates make at most 8 + 6 rows.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from specdecode.config import LOOKAHEAD_CANDIDATES, LOOKAHEAD_NGRAM, LOOKAHEAD_WINDOW
from specdecode.drafters.base import Drafter
from specdecode.sequence import EMPTY_PROPOSAL, DraftProposal, SequenceState
from specdecode.drafters.tree import TokenTrie
from specdecode.errors import InvalidConfigError


MAX_POOL_PER_TOKEN = 8  # n-grams kept per first token, most recent first


class LookaheadDrafter(Drafter):
    name: ClassVar[str] = "lookahead"
    adapts_length: ClassVar[bool] = False  # the tree's depth is the window's, not a draft length

    def __init__(self, window: int = LOOKAHEAD_WINDOW, ngram: int = LOOKAHEAD_NGRAM,
                 candidates: int = LOOKAHEAD_CANDIDATES) -> None:
        if window < 1 or ngram < 2 or candidates < 0:
            raise InvalidConfigError(
                f"lookahead needs window >= 1, ngram >= 2 and candidates >= 0; got {window}, {ngram}, {candidates}")
        self.window, self.ngram, self.candidates = window, ngram, candidates
        self._levels: list[list[int]] = []  # [level][column] guessed tokens
        self._pool: dict[int, list[tuple[int, ...]]] = {}
        self._last_row: list[int | None] = []  # verify row of each last-level window token

    def begin(self, seq: SequenceState) -> None:
        tokens = seq.token_ids
        self._pool.clear()
        for start in range(len(tokens) - self.ngram + 1):
            self._remember(tokens[start : start + self.ngram])
        # Level 0 starts as the context's last tokens: any guess works, Jacobi iterations fix it.
        tail = tokens[-self.window :]
        self._levels = [(tail * self.window)[: self.window]]

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        trie = TokenTrie()
        for guess in self._pool.get(seq.token_ids[-1], [])[: self.candidates]:
            trie.insert(list(guess[:k]), limit=len(trie.tokens) + len(guess))
        tokens, parents = trie.tokens, trie.parents
        grid: list[list[int | None]] = []
        for level, guesses in enumerate(self._levels):
            row: list[int | None] = []
            for col, token in enumerate(guesses):
                if level == 0:
                    parent = -1 if col == 0 else row[col - 1]
                    reachable = col == 0 or parent is not None
                else:
                    parent = grid[level - 1][col]
                    reachable = parent is not None
                if not reachable or level + col + 1 > k:
                    row.append(None)
                    continue
                row.append(len(tokens))
                tokens.append(token)
                parents.append(-1 if parent is None else parent)
            grid.append(row)
        self._last_row = [None if node is None else node + 1 for node in grid[-1]]
        if not tokens:
            return EMPTY_PROPOSAL
        return DraftProposal(torch.tensor(tokens, dtype=torch.long), None, tuple(parents))

    def observe(self, logits: Tensor) -> None:
        """The verify rows [K + 1, V]: the last level's rows give the next Jacobi level."""
        newest, rows = self._levels[-1], self._last_row
        live = [r is not None and r < logits.shape[0] for r in rows]  # the engine may cut a tree
        if not any(live):
            return
        ids = logits.argmax(-1)
        fresh = [int(ids[r]) if ok else newest[c] for c, (r, ok) in enumerate(zip(rows, live))]
        if len(self._levels) == self.ngram - 1:
            for col in range(self.window):
                self._remember([level[col] for level in self._levels] + [fresh[col]])
            self._levels = self._levels[1:]
        self._levels.append(fresh)

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        """The window is relative to the last committed token and simply carries on."""

    def _remember(self, gram: list[int]) -> None:
        guesses = self._pool.setdefault(gram[0], [])
        tail = tuple(gram[1:])
        if tail in guesses:
            guesses.remove(tail)
        guesses.insert(0, tail)
        del guesses[MAX_POOL_PER_TOKEN:]
