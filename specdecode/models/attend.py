"""Attention over a KV cache in three forms, one per guarantee a backend (``backends.py``) needs.

Each writes a chain of rows' keys and values at cache slots ``start..`` of one layer and attends
over the cache up to them: q [N, Hq, d], k/v [N, Hkv, d] -> [N, Hq*d]. ``attend_blocked`` (torch,
blocked over keys, reads a key span and causal mask) and ``attend_rows`` (native, row by row)
give a row the same bits whatever rows share the call, which targets need; ``attend_fast`` (one
fused SDPA call) promises nothing and serves drafts, whose steps are a few milliseconds, so the
invariant path's dozen small ops per layer would be a large share of them.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from specdecode.models import kernels
from specdecode.models.cache import KVCache


class Attend(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, start: int, span: int,
                 bias: Tensor | None, scale: float) -> Tensor: ...


def attend_blocked(q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, start: int, span: int,
                   bias: Tensor | None, scale: float) -> Tensor:
    """Through ``kernels.attention`` over the first ``span`` keys (whole blocks) with the additive
    causal mask ``bias`` [G*N, span]."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    cache.k[layer, :, start : start + n] = k.transpose(0, 1)
    cache.v[layer, :, start : start + n] = v.transpose(0, 1)
    # [N, Hq, d] -> [Hkv, G*N, d]: query heads of one kv head are consecutive in HF layouts.
    qg = q.reshape(n, hkv, hq // hkv, d).permute(1, 2, 0, 3).reshape(hkv, -1, d)
    attn = kernels.attention(qg, cache.k[layer, :, :span], cache.v[layer, :, :span], bias, scale)
    return attn.view(hkv, hq // hkv, n, d).permute(2, 0, 1, 3).reshape(n, hq * d)


def attend_rows(q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, start: int, span: int,
                bias: Tensor | None, scale: float) -> Tensor:
    """Through the row-wise native kernel (``kernels.attention_rows``), which needs no key span or
    mask: each row's causal window follows from its slot."""
    n = q.shape[0]
    cache.k[layer, :, start : start + n] = k.transpose(0, 1)
    cache.v[layer, :, start : start + n] = v.transpose(0, 1)
    return kernels.attention_rows(q, cache.k[layer], cache.v[layer], start, scale)


def attend_fast(q: Tensor, k: Tensor, v: Tensor, cache: KVCache, layer: int, start: int, span: int,
                bias: Tensor | None, scale: float) -> Tensor:
    """Through one fused SDPA call (``span`` and ``bias`` unused), for drafts."""
    n, hq, d = q.shape
    end = start + n
    cache.k[layer, :, start:end] = k.transpose(0, 1)
    cache.v[layer, :, start:end] = v.transpose(0, 1)
    mask = None
    if n > 1:  # row i sees slots 0 .. start + i
        mask = torch.arange(end)[None, :] <= (start + torch.arange(n))[:, None]  # [N, end]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], cache.k[layer, :, :end][None], cache.v[layer, :, :end][None],
        attn_mask=mask, scale=scale, enable_gqa=True)  # [1, Hq, N, d]
    return out[0].transpose(0, 1).reshape(n, hq * d)
