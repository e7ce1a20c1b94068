"""The shapes every layer passes around: a request's committed tokens (``SequenceState``), a
step's drafts (``DraftProposal``) and the outcome of verifying them (``VerifyResult``).

A leaf module, so the sampling rules, the drafters, the KV cache and the engine share these types
without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specdecode.params import SamplingParams


@dataclass(slots=True)
class SequenceState:
    """One request's committed tokens, its race keys (sampling) and its private random stream.

    ``token_ids`` holds prompt + generated tokens. The target's KV cache holds every committed
    token except the last one, which is the first input of the next verify step.
    """

    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator = field(default_factory=torch.Generator)
    grammar: Any = None  # structured output's TokenGrammar (sample/grammar.py), for drafters that follow it
    keys: Any = None  # a sampled request's race keys by position (sample/race.py ``RaceKeys``); None: greedy

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass(frozen=True, slots=True)
class DraftProposal:
    """Draft tokens: a chain (``parents`` None), or a tree of candidate continuations.

    In a tree, ``parents[i]`` is the index of draft i's parent draft, or -1 when draft i directly
    follows the last committed token; parents come before their children. Siblings are
    alternative guesses for the same position: the target verifies every branch in one forward
    and keeps the longest valid path. A tree must be deterministic (``probs`` None): the exact
    sampling rule for several candidates per position (``verify_tree_rejection``) needs point masses.
    """

    tokens: Tensor  # [K] int64, K may be 0 (nothing to propose this step)
    probs: Tensor | None  # [K, V] the drafter's distribution; None = deterministic drafter
    parents: tuple[int, ...] | None = None  # [K] tree structure; None = a chain

    def __post_init__(self) -> None:
        if self.parents is None:
            return
        if self.probs is not None:
            raise ValueError("a draft tree must be deterministic (probs=None)")
        if len(self.parents) != self.k or any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"parents must list, for each of the {self.k} drafts, an earlier draft or -1")

    @property
    def k(self) -> int:
        """Draft tokens the target verifies (tree nodes, for a tree)."""
        return int(self.tokens.shape[0])

    @property
    def depth(self) -> int:
        """The most tokens one verify step can accept: the longest root-to-leaf path."""
        return self.k if self.parents is None else max(self.depths, default=0)

    @property
    def depths(self) -> list[int]:
        """Each draft's depth: 1 for a draft right after the committed tokens (a chain: 1..K)."""
        if self.parents is None:
            return list(range(1, self.k + 1))
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    def row_paths(self) -> list[list[int]]:
        """The drafts before each verify row, root first: none before row 0 (the last committed
        token's); before row i + 1, draft i and its ancestors (a chain: drafts 0..i)."""
        tokens = self.tokens.tolist()
        parents = self.parents if self.parents is not None else range(-1, self.k - 1)
        paths: list[list[int]] = [[]]
        for token, parent in zip(tokens, parents):
            paths.append(paths[parent + 1] + [token])
        return paths

    def truncated(self, n: int) -> "DraftProposal":
        """The first ``n`` drafts (parents precede children, so a tree stays a tree)."""
        if n >= self.k:
            return self
        probs = None if self.probs is None else self.probs[:n]
        parents = None if self.parents is None else self.parents[:n]
        return DraftProposal(self.tokens[:n], probs, parents)

    def kept(self, nodes: list[int]) -> "DraftProposal":
        """Only the drafts ``nodes`` (ascending; each kept draft's parent kept too)."""
        if nodes == list(range(self.k)):
            return self
        if self.parents is None:
            if nodes != list(range(len(nodes))):
                raise ValueError("a chain keeps a prefix of its drafts")
            return self.truncated(len(nodes))
        index = {node: j for j, node in enumerate(nodes)}
        parents = tuple(-1 if self.parents[n] < 0 else index[self.parents[n]] for n in nodes)
        return DraftProposal(self.tokens[nodes], None, parents)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))


EMPTY_PROPOSAL = DraftProposal(torch.empty(0, dtype=torch.long), None)


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Outcome of one verify step, chain or tree."""

    num_accepted: int  # accepted draft tokens, 0..K
    tokens: list[int]  # the accepted draft tokens, then one recovered or bonus token
    rows: list[int] | None = None  # a tree's kept path as verify rows, root (0) first; None: a chain,
    # whose kept rows are its first num_accepted + 1
