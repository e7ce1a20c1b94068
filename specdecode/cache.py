"""Preallocated KV cache with free rollback.

Keys and values live in buffers sized for the whole sequence up front, written by position
(gpt-fast style). The logical ``length`` says how many slots are valid, so rejecting draft tokens
is ``trim(n)``: nothing is copied or freed, later writes simply overwrite the stale slots.
"""

from __future__ import annotations

import torch

from specdecode.errors import PromptTooLongError


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

    def is_trimmable(self) -> bool:
        return True

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
