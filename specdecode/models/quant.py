"""Weight int8 quantization: fbgemm's dynamic int8 linear for draft models, and per-row int8
weights with float activations (``Int8Rows``) for a target the user asks to quantize.

A draft's numerics never affect exactness (the target verifies every token), so the cheapest
draft that still agrees with the target wins. On this CPU fbgemm's int8 linear (int8 weights,
per-channel scales; activations quantized per call) reads a quarter of the fp32 bytes, which is
what bounds one-token decoding. The target stays in float32 unless the user asks otherwise.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

QUANTIZE_MODES = ("int8",)


def usable_mode(mode: str | None, dtype: str) -> str | None:
    """The quantization to apply for a requested ``mode``: None for "none"/None, for a non-float32
    dtype (int8 packs from float32 only), or when this torch build has no fbgemm (warned)."""
    if mode in (None, "none") or dtype != "float32":
        return None
    if mode in QUANTIZE_MODES and "fbgemm" not in torch.backends.quantized.supported_engines:
        print("specdecode: this torch build has no fbgemm; the draft stays in float32", file=sys.stderr)
        return None
    return mode


def pack_int8(w: Tensor) -> Any:
    """[out, in] float weight -> fbgemm prepacked int8 weight with per-output-channel scales."""
    w = w.float()
    scale = (w.abs().amax(dim=1).clamp_min(1e-8) / 127.0).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated API, but fbgemm is current
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None)


def linear_int8(x: Tensor, packed: Any) -> Tensor:
    """``x @ w.T`` through the prepacked int8 weight; x: [N, in] float32."""
    return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, True)


@dataclass(frozen=True, slots=True)
class Int8Rows:
    """An int8 weight [out, in] with one float32 scale per output row, for the *target*:
    ``kernels.linear_int8`` widens each weight to float and keeps the activations in float, so
    a row's result depends on that row alone (fbgemm's dynamic int8, above, shares one activation
    scale between the rows of a call, which would break identity with plain decoding)."""

    q: Tensor  # [out, in] int8
    scale: Tensor  # [out] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> Tensor:
        return self.q.float() * self.scale[:, None]


def quantize_rows(w: Tensor, chunk_rows: int = 4096) -> Int8Rows:
    """Symmetric per-output-row int8: scale = max |w| / 127 per row. Done in row chunks, so
    quantizing a multi-GB matrix never holds a second float copy of it."""
    q = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0], dtype=torch.float32)
    for start in range(0, w.shape[0], chunk_rows):
        rows = w[start : start + chunk_rows].float()
        s = rows.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q[start : start + chunk_rows] = torch.round(rows / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[start : start + chunk_rows] = s
    return Int8Rows(q, scale)
