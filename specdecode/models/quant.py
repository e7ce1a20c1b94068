"""Weight quantization: fbgemm's dynamic int8 linear for draft models, int4 draft weights for
their decode rows (``Int4Groups``; a draft from a GGUF runs its other calls on the GGUF weights
as shipped), and per-row int8 weights with float activations
(``Int8Rows``) for a target the user asks to quantize.

A draft's numerics never affect exactness (the target verifies every token), so the cheapest
draft that still agrees with the target wins. On this CPU fbgemm's int8 linear (int8 weights,
per-channel scales; activations quantized per call) reads a quarter of the fp32 bytes, which is
what bounds one-token decoding. The target stays in float32 unless the user asks otherwise.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specdecode.models.config import DRAFT_MODES

log = logging.getLogger(__name__)

QUANTIZE_MODES = ("int8",)  # for a target
INT4_GROUP = 64  # inputs per int4 scale: one VPDPBUSD (VNNI) or two VPMADDUBSW (AVX2) per group and output
INT4_MAX_ROWS = 8  # calls with more rows (a prefill, or a draft catching up on a long n-gram copy) take int8


def usable_mode(mode: str | None, dtype: str) -> str | None:
    """The draft quantization to apply for a requested ``mode``: None for "none"/None, for a
    non-float32 dtype (packing starts from float32), or when this torch build has no fbgemm
    (warned); "int8" for "int4" where the int4 kernel cannot run (warned by its loader)."""
    if mode in (None, "none") or dtype != "float32":
        return None
    if mode in DRAFT_MODES and "fbgemm" not in torch.backends.quantized.supported_engines:
        log.warning("specdecode: this torch build has no fbgemm; the draft stays in float32")
        return None
    if mode == "int4":
        from specdecode.models import kernel_build

        if kernel_build.load_int4() is None:
            return "int8"
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


def linear_int8_fbgemm(x: Tensor, packed: Any) -> Tensor:
    """``x @ w.T`` through fbgemm's prepacked int8 weight (x: [N, in] float32): fast and not
    batch-invariant, so for drafts only (a target's int8 is ``kernels.linear_int8_invariant``)."""
    return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, True)


@dataclass(frozen=True, slots=True)
class Int4Groups:
    """A draft weight [out, in] for the int4 kernel (``csrc/linear_int4.cpp``): signed 4-bit
    values, one float32 scale per group of ``INT4_GROUP`` inputs, two values per byte, plus a copy
    for calls with many rows (``int8``). Decode rows read 4.5 bits per weight instead of 8; a
    prefill takes a GEMM on the copy. The kernel quantizes activations per row to int8."""

    packed: Tensor  # [out, in / 2] uint8, see the kernel's layout note
    scales: Tensor  # [out, in / INT4_GROUP] float32
    offset: Tensor  # [out] float32: 128 * sum over groups of scale * sum of the group's values
    int8: Any  # for calls of many rows: per-row int8 (Int8Rows), fbgemm prepacked int8, or its GGUF form
    kernel: Any  # the compiled ``linear_int4``, looked up once here rather than per call; or None

    def dequantize(self) -> Tensor:
        out, half = self.packed.shape
        u = self.packed.view(out, -1, INT4_GROUP // 2)
        q = torch.cat([(u & 0x0F), (u >> 4)], dim=-1).float() - 8.0  # [out, groups, INT4_GROUP]
        return (q * self.scales[..., None]).reshape(out, 2 * half)


def pack_int4(w: Tensor, chunk_rows: int = 8192, many_rows: Any = None) -> Any:
    """[out, in] float weight -> ``Int4Groups`` (symmetric, scale = max |w| / 7 per group), or the
    plain int8 pack when ``in`` is not a whole number of groups. In row chunks, so a large
    matrix is never held twice in float. ``many_rows``: what calls of many rows use instead of
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
        s = g.abs().amax(dim=-1).clamp_min(1e-12) / 7.0
        q = torch.round(g / s[..., None]).clamp_(-8, 7)
        offset[start : start + chunk_rows] = 128.0 * (s * q.sum(dim=-1)).sum(dim=-1)
        u = (q + 8).to(torch.uint8)
        half = INT4_GROUP // 2
        packed[start : start + chunk_rows] = (u[..., :half] | (u[..., half:] << 4)).reshape(-1, inp // 2)
        scales[start : start + chunk_rows] = s
    from specdecode.models import kernel_build

    module = kernel_build.load_int4()
    many = pack_int8(w) if many_rows is None else many_rows
    return Int4Groups(packed, scales, offset, many, module.linear_int4 if module else None)


def linear_draft(x: Tensor, w: Any) -> Tensor:
    """A quantized draft's ``x @ w.T``: the int4 kernel for a few rows of an ``Int4Groups``
    weight; otherwise (and where the kernel cannot run) its copy for many rows: the GGUF weight,
    per-row int8 (``Int8Rows``, float activations) or fbgemm's int8."""
    if not isinstance(w, Int4Groups):
        return _many_rows(x, w)
    if x.shape[0] > INT4_MAX_ROWS or w.kernel is None:
        return _many_rows(x, w.int8)
    return w.kernel(x.contiguous(), w.packed, w.scales, w.offset)


def _many_rows(x: Tensor, w: Any) -> Tensor:
    from specdecode.models import kernels
    from specdecode.models.gguf_planes import GGUFLinear

    if isinstance(w, GGUFLinear):
        return kernels.linear_gguf(x, w)
    if isinstance(w, Int8Rows):
        return kernels.linear_int8_invariant(x, w)
    return linear_int8_fbgemm(x, w)


class DraftLinear(torch.nn.Module):
    """An ``nn.Linear`` packed for drafting (``pack_int4``: 4-bit for a few rows where the kernel
    runs, int8 otherwise), its bias kept in float."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.packed = pack_int4(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.out_features = linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        y = linear_draft(x.reshape(-1, x.shape[-1]).float(), self.packed)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


_DRAFT_COPIES: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()


def draft_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of a trained head with every ``nn.Linear`` a ``DraftLinear``: its drafting form.
    A head's one-token steps read every weight once, so bytes decide their cost; the training
    form (float32, and shared with the checkpoint) is left as it is. Made once per head object
    and shared by every drafter of it (one per concurrent request); a head whose weights change
    afterwards must be a new object. Without fbgemm the head drafts in float."""
    import copy

    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return module
    clone = _DRAFT_COPIES.get(module)
    if clone is None:
        clone = copy.deepcopy(module)
        for parent in list(clone.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, DraftLinear(child))
        _DRAFT_COPIES[module] = clone = clone.eval()
    return clone


def fused_int4_draft(model: Any) -> Any:
    """The native whole-forward of an int4 draft ``Decoder`` for its decode rows
    (``Int4Draft`` in ``csrc/linear_int4.cpp``), or None unless every linear weight is
    ``Int4Groups`` with its kernel. A one-row draft forward spends most of its time in torch's
    per-op dispatch (some 40 small ops per layer), not in its weights; this removes it."""
    weights = [model.lm_head] + [getattr(w, f) for w in model.layers for f in ("qkv", "o", "gate_up", "down")]
    if not all(isinstance(w, Int4Groups) and w.kernel is not None for w in weights):
        return None
    from specdecode.models import kernel_build

    def parts(w: Int4Groups) -> list[Tensor]:
        return [w.packed, w.scales, w.offset]

    cfg = model.config
    empty = torch.empty(0)
    embed = model.embed.contiguous() if isinstance(model.embed, Tensor) else empty  # GGUF rows: looked up by the caller
    layers = [[w.in_norm, w.post_norm, w.qkv_bias if w.qkv_bias is not None else empty,
               *parts(w.qkv), *parts(w.o), *parts(w.gate_up), *parts(w.down)] for w in model.layers]
    return kernel_build.load_int4().Int4Draft(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                                              embed, model.cos, model.sin, model.norm,
                                              parts(model.lm_head), layers)


@dataclass(frozen=True, slots=True)
class Int8Rows:
    """An int8 weight [out, in] with one float32 scale per output row, for the *target*:
    ``kernels.linear_int8_invariant`` widens each weight to float and keeps the activations in float, so
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
