"""An int4 draft's whole decode-row forward in one native call (``Int4Draft``, ``csrc/linear_int4.cpp``).

A one-row step of a small draft spends most of its time in torch's per-op dispatch (some 40 small
ops per layer), not in its weights; running every layer in one call removes that. It serves the
calls of up to ``draft_quant.FUSED_MAX_ROWS`` rows of a draft whose every linear weight is
``Int4Groups``, and the draft steps of several requests together (``forward_batch``: a server's
batch, whose requests then share one read of the weights); the draft's other calls take its
torch layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from specdecode.models import kernel_build
from specdecode.models.config import ModelConfig
from specdecode.models.draft_quant import Int4Groups

if TYPE_CHECKING:
    from specdecode.models.weights import DecoderWeights


class FusedForward(Protocol):
    def forward(self, rows: Tensor, k: Tensor, v: Tensor, start: int, last_only: bool, head: bool = True) -> Tensor:
        """Logits [N, V] (or [1, V]) of ``rows`` (token ids [N], or embedding rows [N, D] when the
        embedding is a GGUF table) at cache slots ``start..`` of the cache ``k``/``v``, which it fills;
        with ``head`` False, no logits (an empty [0, V]): a chunk of a long input before its last."""
        ...

    def forward_batch(self, rows: Tensor, k_caches: list[Tensor], v_caches: list[Tensor], starts: list[int],
                      counts: list[int], last_only: bool) -> Tensor:
        """Logits of several sequences' ``rows`` (as ``forward``'s, ``counts[i]`` of sequence i at
        slots ``starts[i]..`` of its own cache) in one forward: every row's, or each sequence's
        last with ``last_only``. The weights are read once for all of them."""
        ...


def fused_int4_draft(config: ModelConfig, weights: DecoderWeights) -> FusedForward | None:
    """The native whole forward of an int4 draft for its decode rows, or None unless every linear
    weight is ``Int4Groups`` with its kernel."""
    matrices = [weights.lm_head] + [getattr(w, f) for w in weights.layers for f in ("qkv", "o", "gate_up", "down")]
    if not all(isinstance(w, Int4Groups) and w.kernel is not None for w in matrices):
        return None

    def parts(w: Int4Groups) -> list[Tensor]:
        return [w.packed, w.scales, w.offset]

    empty = torch.empty(0)
    embed = weights.embed.contiguous() if isinstance(weights.embed, Tensor) else empty  # GGUF rows: looked up by the caller
    layers = [[w.in_norm, w.post_norm, w.qkv_bias if w.qkv_bias is not None else empty,
               *parts(w.qkv), *parts(w.o), *parts(w.gate_up), *parts(w.down)] for w in weights.layers]
    return kernel_build.load_int4().Int4Draft(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps,
                                        embed, weights.cos, weights.sin, weights.norm,
                                        parts(weights.lm_head), layers)
