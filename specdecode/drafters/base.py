"""The drafter contract shared by every speculative method.

A drafter sees the committed tokens of one sequence and proposes up to ``k`` continuations. The
engine verifies them with the target and tells the drafter how many were kept, so a stateful
drafter (one with its own KV cache) can roll back. Drafters declare what they need; the engine
never branches on a method's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from specdecode.config import SamplingParams


@dataclass(slots=True)
class SequenceState:
    """One request's committed tokens and its private random stream.

    ``token_ids`` holds prompt + generated tokens. The target's KV cache holds every committed
    token except the last one, which is the first input of the next verify step.
    """

    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator = field(default_factory=torch.Generator)
    grammar: Any = None  # structured output's TokenGrammar (sample/grammar.py), for drafters that follow it

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
    sampling rule for several candidates per position (``verify_tree``) needs point masses.
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
        if self.parents is None:
            return self.k
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return max(depths, default=0)

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


def pick_from_subvocabulary(logits: Tensor, target_ids: Tensor, vocab_size: int, seq: SequenceState,
                            need_prob: bool) -> tuple[int, Tensor | None, float]:
    """One draft token from a trained head's logits over its own vocabulary ``target_ids`` (the
    target ids of its entries): the argmax for a greedy request, else a sample under the
    request's rule from the head's distribution spread over the target vocabulary (zero
    elsewhere), which the exact rejection rule needs. Returns the target id, that distribution
    (None when greedy) and the token's probability (1.0 when greedy and not ``need_prob``)."""
    from specdecode.sample.sampling import logits_to_probs, sample

    if seq.params.greedy:
        choice = int(logits.argmax())
        p_token = float(torch.softmax(logits, -1)[choice]) if need_prob else 1.0
        return int(target_ids[choice]), None, p_token
    full = torch.full((vocab_size,), -torch.inf)
    full[target_ids] = logits
    probs = logits_to_probs(full[None], seq.params)
    token = int(sample(probs, seq.generator)[0])
    return token, probs[0], float(probs[0, token])


def most_probable_tree(tokens: list[int], parents: list[int], scores: list[float], k: int) -> DraftProposal:
    """The ``k`` candidates of highest path log-probability ``scores`` as a tree proposal.

    Candidates are listed parents first (``parents[i]`` < i, -1 for the root's children). A
    child's path is never more probable than its parent's, and ties go to the earlier candidate,
    so the kept set holds every kept candidate's parent.
    """
    keep = sorted(sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:k])
    index = {node: j for j, node in enumerate(keep)}
    return DraftProposal(torch.tensor([tokens[i] for i in keep], dtype=torch.long), None,
                         tuple(-1 if parents[i] < 0 else index[parents[i]] for i in keep))


class Drafter(ABC):
    """Base of every drafter. The engine calls each hook at its moment, unconditionally; the
    defaults do nothing, so a drafter overrides only what it uses.

    ``adapts_length``: the engine may shorten or lengthen ``k`` with the acceptance (False for a
    drafter whose proposal size is its own, like a lookahead window). ``needs_hidden_states``:
    every target forward captures the states of ``hidden_layers`` (see ``HiddenCapture``) and
    the drafter gets them through ``observe_hidden`` (trained heads).
    """

    name: ClassVar[str]
    adapts_length: ClassVar[bool] = True
    needs_hidden_states: ClassVar[bool] = False
    hidden_layers: tuple[int, ...] = ()

    def begin(self, seq: SequenceState) -> None:
        """A new request: index the prompt, prefill a draft model, reset state."""

    @abstractmethod
    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        """Up to ``k`` draft tokens continuing ``seq.token_ids``: the one hook every drafter defines."""

    def observe(self, logits: Tensor) -> None:
        """The verify forward's logits [rows, V], before ``accept`` (drafters that learn from them)."""

    def observe_hidden(self, states: Tensor) -> None:
        """The target's hidden states [n, len(hidden_layers) * D] of the tokens committed since the
        last call, in order: after the prompt, every prompt token; after a verify step, the step's
        first token and its accepted drafts. So the states seen cover every committed token but
        the last, whose states the next verify forward computes (as the target's KV cache does).
        Called before ``begin`` finishes a prefill's work and before ``accept``."""

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        """The first ``n_accepted`` drafts were kept and one more token was appended to ``seq``."""

    def catch_up(self, seq: SequenceState) -> int:
        """Committed tokens this drafter must run through its own model before it can draft again,
        beyond the few a draft step feeds anyway: a prefill's worth after the prompt or a stretch
        of steps without drafts. A server under load weighs this before asking for drafts."""
        return 0

    def pop_catch_up(self) -> tuple[int, float] | None:
        """The last catch-up this drafter ran since asked: (tokens, seconds), or None."""
        return None

    def finish(self, seq: SequenceState) -> None:
        """The request ended (drafters that learn from whole requests)."""
