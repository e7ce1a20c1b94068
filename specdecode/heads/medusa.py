"""Medusa-1 heads: small residual blocks on the target's last hidden state, head k guessing the
token k + 2 places ahead.

The target's final (normed) hidden state at the last committed position already yields the next
token through the target's LM head; head k adds ``num_layers`` blocks x + SiLU(W x + b) and its
own LM head to guess the token after that one, k places further. The heads read nothing but
that state, so all of them run in one cheap pass and never see each other's guesses: their
drafts form a chain (each head's best) or a tree (each head's top tokens combined).

Layout and names follow vLLM's Medusa (``blocks.{k}.layers.{j}``, ``lm_heads.{k}``); the LM heads
cover a truncated vocabulary (the tokens the target predicts most), mapped to target ids by
``token_map`` as vLLM's ``truncated_vocab_size`` does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int  # the target's vocabulary
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    truncated_vocab_size: int | None = None  # None: the whole vocabulary

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError("need at least one head and one layer per head")
        if self.truncated_vocab_size is not None and not 1 <= self.truncated_vocab_size <= self.vocab_size:
            raise ValueError(f"truncated_vocab_size must be in [1, {self.vocab_size}]")

    @property
    def draft_vocab_size(self) -> int:
        return self.truncated_vocab_size or self.vocab_size

    def to_dict(self) -> dict:
        return asdict(self)


class _ResidualBlock(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=True) for _ in range(layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.blocks = nn.ModuleList(_ResidualBlock(cfg.hidden_size, cfg.num_layers) for _ in range(cfg.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
                                      for _ in range(cfg.num_heads))
        self.register_buffer("token_map", torch.arange(cfg.draft_vocab_size, dtype=torch.int64))

    def set_vocabulary(self, target_ids: Tensor) -> None:
        """Make the heads' vocabulary the target ids ``target_ids`` (ascending)."""
        ids = target_ids.to(torch.int64)
        if ids.shape != self.token_map.shape or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"need {self.token_map.shape[0]} ascending target ids")
        self.token_map.copy_(ids)

    @property
    def target_ids(self) -> Tensor:
        return self.token_map

    def forward(self, hidden: Tensor) -> list[Tensor]:
        """The target's final normed hidden states [N, H] -> each head's logits [N, draft vocab]."""
        return [lm_head(block(hidden)) for block, lm_head in zip(self.blocks, self.lm_heads)]
