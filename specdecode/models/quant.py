"""Weight int8 quantization for draft models (fbgemm's dynamic int8 linear).

A draft's numerics never affect exactness (the target verifies every token), so the cheapest
draft that still agrees with the target wins. On this CPU fbgemm's int8 linear (int8 weights,
per-channel scales; activations quantized per call) reads a quarter of the fp32 bytes, which is
what bounds one-token decoding. The target stays in float32 unless the user asks otherwise.
"""

from __future__ import annotations

import sys
import warnings
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
