"""An int4 draft's whole decode-row forward in one native call (``Int4Draft``, ``csrc/linear_int4.cpp``).

A one-row step of a small draft spends most of its time in torch's per-op dispatch (some 40 small
ops per layer), not in its weights; running every layer in one call removes that. It serves the
calls of a few rows (``draft_quant.INT4_MAX_ROWS``) of a draft whose every linear weight is
``Int4Groups``; the draft's other calls take its torch layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specdecode.models import native
from specdecode.models.draft_quant import Int4Groups


def fused_int4_draft(model: Any) -> Any:
    """The native whole forward of an int4 draft ``Decoder`` for its decode rows, or None unless
    every linear weight is ``Int4Groups`` with its kernel."""
    weights = [model.lm_head] + [getattr(w, f) for w in model.layers for f in ("qkv", "o", "gate_up", "down")]
    if not all(isinstance(w, Int4Groups) and w.kernel is not None for w in weights):
        return None

    def parts(w: Int4Groups) -> list[Tensor]:
        return [w.packed, w.scales, w.offset]

    cfg = model.config
    empty = torch.empty(0)
    embed = model.embed.contiguous() if isinstance(model.embed, Tensor) else empty  # GGUF rows: looked up by the caller
    layers = [[w.in_norm, w.post_norm, w.qkv_bias if w.qkv_bias is not None else empty,
               *parts(w.qkv), *parts(w.o), *parts(w.gate_up), *parts(w.down)] for w in model.layers]
    return native.load_int4().Int4Draft(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                                        embed, model.cos, model.sin, model.norm,
                                        parts(model.lm_head), layers)
