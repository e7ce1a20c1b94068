"""Draft weights packed for speed: fbgemm's dynamic int8, and int4 groups for decode rows.

A draft's numerics never affect exactness (the target verifies every token), so the cheapest
draft that still agrees with the target wins. A one-token draft step reads every weight once, so
bytes bound it: fbgemm's int8 linear (int8 weights, per-channel scales, activations quantized per
call) reads a quarter of the float32 bytes, ``Int4Groups`` an eighth for calls of a few rows
(``csrc/linear_int4.cpp``). Calls of many rows (a prompt's prefill) take a copy whose
activations stay in float: per-row int8 (``Int8Rows``), or the GGUF weight as shipped for a
draft loaded from a GGUF. A target's int8 is ``int8_rows.py``, not this.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.models import kernel_build, kernels
from specdecode.models.config import DRAFT_MODES
from specdecode.models.gguf_planes import GGUFLinear

log = logging.getLogger(__name__)
from specdecode.models.int8_rows import Int8Rows, quantize_rows

INT4_GROUP = 64  # inputs per int4 scale: one VPDPBUSD (VNNI) or two VPMADDUBSW (AVX2) per group and output
INT4_MAX_ROWS = 8  # calls with more rows (a prefill, or a draft catching up on a long n-gram copy) take int8
# Rows per call of an int4 draft's whole native forward (``int4_forward.py``): a longer input (a
# prompt, a catch-up) runs as chunks of this many, each streaming the weights once for all its rows.
FUSED_MAX_ROWS = 32

FbgemmInt8 = torch.ScriptObject  # fbgemm's prepacked int8 weight (``pack_int8``)
ManyRows = Int8Rows | FbgemmInt8 | GGUFLinear  # what an int4 weight's calls of many rows run on


def usable_mode(mode: str | None, dtype: str) -> str | None:
    """The draft quantization to apply for a requested ``mode``: None for "none"/None, for a
    non-float32 dtype (packing starts from float32), or when this torch build has no fbgemm
    (warned); "int8" for "int4" where the int4 kernel cannot run (warned by its loader)."""
    if mode in (None, "none") or dtype != "float32":
        return None
    if mode in DRAFT_MODES and "fbgemm" not in torch.backends.quantized.supported_engines:
        log.warning("specdecode: this torch build has no fbgemm; the draft stays in float32")
        return None
    if mode == "int4" and kernel_build.load_int4() is None:
        return "int8"
    return mode


def pack_int8(w: Tensor) -> FbgemmInt8:
    """[out, in] float weight -> fbgemm prepacked int8 weight with per-output-channel scales."""
    w = w.float()
    scale = (w.abs().amax(dim=1).clamp_min(1e-8) / 127.0).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated API, but fbgemm is current
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None)


def linear_int8_fbgemm(x: Tensor, packed: FbgemmInt8) -> Tensor:
    """``x @ w.T`` through fbgemm's prepacked int8 weight (x: [N, in] float32): fast and not
    batch-invariant, so for drafts only (a target's int8 is ``kernels.linear_int8_invariant``)."""
    return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, True)


@dataclass(frozen=True, slots=True)
class Int4Groups:
    """A draft weight [out, in] for the int4 kernel (``csrc/linear_int4.cpp``): signed 4-bit
    values, one scale per group of ``INT4_GROUP`` inputs, two values per byte, plus a copy for
    calls with many rows (``int8``). Decode rows read 4.25-4.5 bits per weight instead of 8; a
    prefill takes a GEMM on the copy. The kernel quantizes activations per row to int8. Any
    subset of rows (``packed[rows]``, ``scales[rows]``, ``offset[rows]``) is again such a weight."""

    packed: Tensor  # [out, in / 2] uint8, see the kernel's layout note
    scales: Tensor  # [out, in / INT4_GROUP] float32 holding float16 values (the fused forward streams them as such)
    offset: Tensor  # [out] float32: 128 * sum over groups of scale * sum of the group's values
    int8: ManyRows  # for calls of many rows: per-row int8, fbgemm prepacked int8, or its GGUF form
    kernel: object  # the compiled ``linear_int4``, looked up once here rather than per call; or None

    def dequantize(self) -> Tensor:
        out, half = self.packed.shape
        u = self.packed.view(out, -1, INT4_GROUP // 2)
        q = torch.cat([(u & 0x0F), (u >> 4)], dim=-1).float() - 8.0  # [out, groups, INT4_GROUP]
        return (q * self.scales[..., None]).reshape(out, 2 * half)


DraftWeight = Int4Groups | ManyRows  # a quantized draft's linear weight


def pack_int4(w: Tensor, chunk_rows: int = 8192, many_rows: ManyRows | None = None) -> DraftWeight:
    """[out, in] float weight -> ``Int4Groups`` (symmetric, scale = max |w| / 7 per group, rounded
    to a float16 value), or the plain int8 pack when ``in`` is not a whole number of groups. In
    row chunks, so a large matrix is never held twice in float. ``many_rows``: what calls of many rows use instead of
    an int8 copy (a GGUF weight, which the GGUF kernel runs as shipped)."""
    w = w.float()
    out, inp = w.shape
    if inp % INT4_GROUP:
        return pack_int8(w) if many_rows is None else many_rows
    groups = inp // INT4_GROUP
    packed = torch.empty(out, inp // 2, dtype=torch.uint8)
    scales = torch.empty(out, groups, dtype=torch.float32)
    offset = torch.empty(out, dtype=torch.float32)
    for start in range(0, out, chunk_rows):
        g = w[start : start + chunk_rows].reshape(-1, groups, INT4_GROUP)
        s = (g.abs().amax(dim=-1) / 7.0).clamp_min(2.0**-24).half().float()  # the least float16 above 0
        q = torch.round(g / s[..., None]).clamp_(-8, 7)
        offset[start : start + chunk_rows] = 128.0 * (s * q.sum(dim=-1)).sum(dim=-1)
        u = (q + 8).to(torch.uint8)
        half = INT4_GROUP // 2
        packed[start : start + chunk_rows] = (u[..., :half] | (u[..., half:] << 4)).reshape(-1, inp // 2)
        scales[start : start + chunk_rows] = s
    module = kernel_build.load_int4()
    many = pack_int8(w) if many_rows is None else many_rows
    return Int4Groups(packed, scales, offset, many, module.linear_int4 if module else None)


def pack_draft(w: Tensor | GGUFLinear, mode: str) -> DraftWeight:
    """One matrix of a draft in ``mode`` ("int8" or "int4"). Calls of many rows (the prompt's
    prefill) keep float activations: on the GGUF weight as shipped, or per-row int8 weights
    (fbgemm's one activation scale per call lets one row's outliers blur the rest). A weight
    already packed for int4 (from the cache ``gguf_load.int4_draft_weights`` keeps) stays as it is."""
    if isinstance(w, Int4Groups) and mode == "int4":
        return w
    if isinstance(w, GGUFLinear) and mode == "int4":  # not whole groups: the GGUF weight as shipped
        return w if w.shape[1] % INT4_GROUP else pack_int4(w.dequantize(), many_rows=w)
    if isinstance(w, GGUFLinear):
        return pack_int8(w.dequantize())
    return pack_int4(w, many_rows=quantize_rows(w)) if mode == "int4" else pack_int8(w)


def linear_draft(x: Tensor, w: DraftWeight) -> Tensor:
    """A quantized draft's ``x @ w.T``: the int4 kernel for a few rows of an ``Int4Groups``
    weight; otherwise (and where the kernel cannot run) its copy for many rows: the GGUF weight,
    per-row int8 (``Int8Rows``, float activations) or fbgemm's int8."""
    if not isinstance(w, Int4Groups):
        return _many_rows(x, w)
    if x.shape[0] > INT4_MAX_ROWS or w.kernel is None:
        return _many_rows(x, w.int8)
    return w.kernel(x.contiguous(), w.packed, w.scales, w.offset)


def _many_rows(x: Tensor, w: ManyRows) -> Tensor:
    if isinstance(w, GGUFLinear):
        return kernels.linear_gguf(x, w)
    if isinstance(w, Int8Rows):
        return kernels.linear_int8_invariant(x, w)
    return linear_int8_fbgemm(x, w)
