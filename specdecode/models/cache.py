"""Preallocated KV cache with free rollback.

Keys and values live in buffers sized for the whole sequence up front, written by position
(gpt-fast style). The logical ``length`` says how many slots are valid, so rejecting draft tokens
is ``trim(n)``: nothing is copied or freed, later writes simply overwrite the stale slots.

A tree verify step writes its nodes' keys and values to a small side buffer in node order
(``node_k``/``node_v``) while the main slots serve each branch in turn; ``keep_rows`` then copies the
accepted path into place, so the cache again holds one sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdecode.errors import PromptTooLongError

if TYPE_CHECKING:
    from specdecode.sequence import VerifyResult


class KVCache:
    """Keys and values of one sequence for every layer: ``[layers, kv_heads, capacity, head_dim]``."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.capacity = capacity
        self.length = 0
        self.node_k: torch.Tensor | None = None  # [layers, kv_heads, nodes, head_dim] of a tree step
        self.node_v: torch.Tensor | None = None
        self._tree_start = 0

    def tree_buffers(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Side buffers for the ``n`` rows of a tree step that reserved slots from ``start``."""
        layers, heads, _, dim = self.k.shape
        if self.node_k is None or self.node_k.shape[2] < n:
            self.node_k = self.k.new_empty(layers, heads, n, dim)
            self.node_v = self.v.new_empty(layers, heads, n, dim)
        self._tree_start = start
        return self.node_k, self.node_v

    def keep_rows(self, rows: list[int]) -> None:
        """After a tree step: keep the step's ``rows`` (its kept path, root first) as consecutive
        tokens from the step's first slot and forget the other rows."""
        start = self._tree_start
        if self.node_k is None or start + len(rows) > self.length:
            raise ValueError("keep_rows needs a tree step in the cache")
        index = torch.tensor(rows)
        self.k[:, :, start : start + len(rows)] = self.node_k.index_select(2, index)
        self.v[:, :, start : start + len(rows)] = self.node_v.index_select(2, index)
        self.length = start + len(rows)

    def commit(self, result: VerifyResult, step_rows: int) -> None:
        """Keep what a verify step of ``step_rows`` rows accepted: a tree's kept path, copied into
        place, or a chain's first ``num_accepted + 1`` rows, the rejected rows trimmed."""
        if result.rows is not None:
            self.keep_rows(result.rows)
        else:
            self.trim(step_rows - 1 - result.num_accepted)

    def reserve(self, n: int) -> int:
        """Claim ``n`` slots after the valid ones; return the first slot. Raises if they do not fit."""
        start = self.length
        if start + n > self.capacity:
            raise PromptTooLongError(
                f"sequence of {start + n} tokens exceeds the context of {self.capacity} tokens; "
                "shorten the prompt or lower max_tokens"
            )
        self.length = start + n
        return start

    def trim(self, n: int) -> None:
        """Forget the last ``n`` tokens (rejected drafts). O(1)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot trim {n} of {self.length} cached tokens")
        self.length -= n

    def reset(self) -> None:
        self.length = 0

    def copy_prefix(self, source: KVCache, n: int) -> None:
        """Hold ``source``'s first ``n`` tokens, and only those (a cached prefix resumed, or a
        prompt another sample of it prefilled)."""
        self.k[:, :, :n] = source.k[:, :, :n]
        self.v[:, :, :n] = source.v[:, :, :n]
        self.length = n
