"""EAGLE-3 drafting: a trained head on the target's hidden states proposes a chain or a tree.

The head (``heads/eagle3.py``) keeps its own KV cache of one layer. Its rows for committed
positions are built from the target's real hidden states, which every verify forward captures
for free (``needs_hidden_states``): ``observe_hidden`` hands over the states of the newly
committed tokens, and ``propose`` first runs the head over them (one row each, appended to its
cache for good), then drafts. Draft rows go to the slots after those and are forgotten when the
proposal is made: once verified, the kept tokens' rows are rebuilt from the target's states,
which are better than the head's own guesses.

- **Chain** (``tree_width`` 0): the head's choice each step, from its own last output, until the
  draft is unsure (the running product of its probabilities falls below ``confidence``) or K.
- **Tree** (EAGLE-2's dynamic tree, ``tree_width`` w): at each depth the w most probable paths
  so far are expanded in one head forward (each row sees the cache and its own ancestors), each
  by its w most probable next tokens; after ``depth`` levels the K candidates of highest path
  probability form the tree the target verifies in one forward. A tree is deterministic, so it
  is exact for sampled requests too (``sample/tree.py``).

Any proposal is exact: the target's verify rule decides what is kept. For sampled chains the
proposal carries the head's distribution over the target vocabulary (zero outside the draft
vocabulary), which the rejection rule needs.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from specdecode.drafters.base import Drafter, most_probable_tree, pick_from_subvocabulary
from specdecode.sequence import DraftProposal, SequenceState
from specdecode.heads.eagle3 import Eagle3Head, attention
from specdecode.models.draft_heads import draft_copy
from specdecode.models.decoder import Decoder

_EMPTY = DraftProposal(torch.empty(0, dtype=torch.long), None)


class EagleDrafter(Drafter):
    name: ClassVar[str] = "eagle"
    draft_cost_prior: ClassVar[float] = 0.1  # one decoder layer and the LM head
    stops_by_confidence: ClassVar[bool] = True
    needs_hidden_states: ClassVar[bool] = True

    def __init__(self, head: Eagle3Head, target: Decoder, capacity: int, confidence: float = 0.0,
                 tree_width: int = 0, tree_depth: int = 6, quantize: bool = True) -> None:
        cfg = head.config
        # Drafts only propose, so their numerics never change the output: the head drafts with
        # 4-bit weights (``draft_heads.draft_copy``), which a one-token step reads an eighth of.
        self.head = draft_copy(head.eval()) if quantize else head.eval()
        self.embed = target.embed_tokens
        self.hidden_layers = cfg.hidden_layers
        self.confidence = confidence
        self.tree_width, self.tree_depth = tree_width, tree_depth
        self.adapts_length = tree_width == 0  # a tree's size is K; its depth is its own
        room = capacity + max(tree_depth * max(tree_width, 1), 64)  # draft rows beyond the sequence
        self.keys = torch.zeros(room, cfg.num_kv_heads, cfg.head_dim)  # the head's own KV cache
        self.values = torch.zeros(room, cfg.num_kv_heads, cfg.head_dim)
        self.length = 0  # committed positions whose head rows are cached
        self.pending: list[Tensor] = []  # target states not yet run through the head
        self.target_ids = head.target_ids
        self.vocab_size = cfg.vocab_size

    def begin(self, seq: SequenceState) -> None:
        self.length = 0
        self.pending.clear()

    def observe_hidden(self, states: Tensor) -> None:
        self.pending.append(states)

    @torch.inference_mode()
    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        last = self._catch_up(seq)
        if last is None:
            return _EMPTY
        if self.tree_width:
            return self._tree(last, k)
        return self._chain(last, k, seq)

    def _catch_up(self, seq: SequenceState) -> Tensor | None:
        """Run the head over the committed positions it has not seen; return its last output
        [1, H] (which predicts the token after the last committed one), None with nothing new."""
        if not self.pending:
            return None
        states = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending.clear()
        start, n = self.length, states.shape[0]
        if start + n != len(seq.token_ids) - 1:
            raise RuntimeError(f"head rows out of step: {start} cached + {n} new for {len(seq.token_ids)} tokens")
        tokens = torch.tensor(seq.token_ids[start + 1 : start + n + 1])
        out = self._rows(self.head.project(states), tokens, start, torch.arange(start, start + n), None)
        self.length = start + n
        return out[-1:]

    def _rows(self, feature: Tensor, tokens: Tensor, slot: int, positions: Tensor, sees: Tensor | None) -> Tensor:
        """Head rows at cache slots ``slot``.. : each sees the committed rows and, among the draft
        slots up to its own, those ``sees`` [N, slots from ``self.length``] allows (None: causal)."""
        n = feature.shape[0]
        end = slot + n

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            self.keys[slot:end], self.values[slot:end] = k, v
            mask = torch.ones(n, end, dtype=torch.bool)
            if sees is None:
                mask = mask.tril(diagonal=slot)
            else:
                mask[:, self.length :] = sees
            return attention(q, self.keys[:end], self.values[:end], mask)

        return self.head.layer(feature, self.embed(tokens), positions, attend)

    def _chain(self, feature: Tensor, k: int, seq: SequenceState) -> DraftProposal:
        tokens, probs = [], []
        cumulative = 1.0
        slot = self.length
        for i in range(k):
            token, p, p_token = pick_from_subvocabulary(self.head.logits(feature)[0], self.target_ids, self.vocab_size,
                                                        seq, self.confidence > 0)
            if p is not None:
                probs.append(p)
            tokens.append(token)
            cumulative *= p_token
            if i + 1 == k or cumulative < self.confidence:
                break
            position = torch.tensor([slot])  # draft i + 2 runs one position after draft i + 1's row
            feature = self._rows(feature, torch.tensor([token]), slot, position, None)
            slot += 1
        return DraftProposal(torch.tensor(tokens), torch.stack(probs) if probs else None)

    def _tree(self, root: Tensor, k: int) -> DraftProposal:
        """EAGLE-2's dynamic tree of at most ``k`` nodes (see the module docstring)."""
        w = self.tree_width
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []  # log-probability of the path to each node
        slot_of: dict[int, int] = {}  # expanded node -> its draft slot, counted from self.length
        frontier, outputs = [-1], root  # expanded nodes (-1: the last committed token), their outputs
        for depth in range(min(self.tree_depth, k)):
            logp = torch.log_softmax(self.head.logits(outputs), dim=-1)  # [len(frontier), draft vocab]
            top = logp.topk(min(w, logp.shape[-1]), dim=-1)
            children = []
            for row, node in enumerate(frontier):
                base = 0.0 if node < 0 else scores[node]
                for lp, choice in zip(top.values[row].tolist(), top.indices[row].tolist()):
                    children.append(len(tokens))
                    tokens.append(int(self.target_ids[choice]))
                    parents.append(node)
                    scores.append(base + lp)
            if depth + 1 == min(self.tree_depth, k):
                break
            chosen = sorted(children, key=lambda i: (-scores[i], i))[:w]
            feature = outputs[[frontier.index(parents[i]) for i in chosen]]  # each row's parent's output
            for node in chosen:
                slot_of[node] = len(slot_of)
            sees = torch.zeros(len(chosen), len(slot_of), dtype=torch.bool)
            for j, node in enumerate(chosen):
                while node >= 0:  # the row sees itself and its ancestors, all expanded earlier
                    sees[j, slot_of[node]] = True
                    node = parents[node]
            slot = self.length + slot_of[chosen[0]]
            positions = torch.full((len(chosen),), self.length + depth)
            outputs = self._rows(feature, torch.tensor([tokens[i] for i in chosen]), slot, positions, sees)
            frontier = chosen
        return most_probable_tree(tokens, parents, scores, k)
