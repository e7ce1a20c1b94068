"""Batch-invariant building blocks: a row's result never depends on how many rows share the call.

Why: speculative decoding verifies K drafts in one forward of K+1 rows, while plain decoding runs
one row at a time. If a row rounded differently in the two cases, a near-tie in the logits could
flip the argmax and the "lossless" output would drift from plain decoding.

Linear layers take weights ``[out, in]``. The fast path is the native kernel (``kernel_build.py``),
invariant for every row count including one. The portable torch path and attention rely on
measurements (torch 2.13, fp32, MKL; ``python scripts/blas_invariance.py``): calls with fewer
than ``MIN_GEMM_ROWS`` rows take small-matrix kernels that round differently (one row: GEMV; two
or three rows too, e.g. for a reduction length of 1536 or a head dim of 128 with 1-3 query heads
per kv head), so short calls are padded with zero rows. So padded, attention's batched GEMMs give
a row the same bits for every row count and position on both CPUs measured (Intel, AMD EPYC);
the linear layout ``w @ x.T`` does not on the AMD one (rows change bits in calls of 9 or more
rows), so the portable linear always calls BLAS with exactly ``MIN_GEMM_ROWS`` rows. The
reductions in attention also run over fixed-size key blocks so that extra (masked, exactly zero)
keys never regroup the sums of the real ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from specdecode.models import kernel_build

if TYPE_CHECKING:
    from specdecode.models.gguf_planes import GGUFLinear
    from specdecode.models.int8_rows import Int8Rows

KEY_BLOCK = 128  # keys per attention block; below any BLAS K-blocking, so one block = one pass
MIN_GEMM_ROWS = 8  # fewer rows than this take BLAS small-matrix paths; we pad up to it


# Calls with more rows than this are prompt prefills, never decode or verify steps (K <= 32).
# A prefill is the same call for every method, so it needs no invariance and takes BLAS GEMM,
# which is compute-efficient at many rows where the row-streaming kernels are not. On the 1.5B
# float32 target the two cost about the same at 40 rows (the native kernel is faster below, BLAS
# above), and 40 is above a verify's 33 rows, so the line sits there.
PREFILL_ROWS = 40


@dataclass(frozen=True)
class LinearKernel:
    """A model's linear kernel and its guarantee. An ``invariant`` kernel gives a row the same
    bits in every call shape when called with ``invariant=True`` (the decode rows of many
    sequences verified together need it); a fast one (drafts) promises nothing."""

    fn: Callable[..., Tensor]
    invariant: bool
    always: bool = False  # invariant even when not asked (one integer kernel for every row count)

    def __call__(self, x: Tensor, w: Any, **kwargs: Any) -> Tensor:
        return self.fn(x, w, **kwargs)

    def rows(self, x: Tensor, w: Any) -> Tensor:
        """``x @ w.T`` for rows that must keep their bits however many share the call."""
        return self.fn(x, w, invariant=True) if self.invariant else self.fn(x, w)


def linear_invariant_portable(x: Tensor, w: Tensor, invariant: bool = False) -> Tensor:
    """``x @ w.T`` through BLAS calls of exactly ``MIN_GEMM_ROWS`` rows each (zero-padded), so
    every row meets the same GEMM kernel whatever the row count. One call per row count is not
    enough: on an AMD EPYC (AVX2) calls of 9 or more rows give some rows other bits than alone
    (``python scripts/blas_invariance.py``). Prefills (more than ``PREFILL_ROWS`` rows, the same
    call for every method) take one call unless ``invariant`` insists (batched decode rows of many
    sequences).

    x: [N, in]; w: [out, in] -> [N, out].
    """
    n = x.shape[0]
    if n > PREFILL_ROWS and not invariant:
        return torch.nn.functional.linear(x, w)
    # Contiguous results: a reduction over a transposed view may group its sums by row count.
    chunks = [(w @ _pad_rows(c, 0).T).T for c in x.split(MIN_GEMM_ROWS)]
    return torch.cat(chunks)[:n].contiguous()


def _pad_rows(x: Tensor, dim: int) -> Tensor:
    """``x`` with zero rows appended along ``dim`` up to ``MIN_GEMM_ROWS`` (see module docstring)."""
    short = MIN_GEMM_ROWS - x.shape[dim]
    if short <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def linear_fast(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w.T`` without invariance care (plain ``F.linear``): for drafts, whose numerics never
    affect exactness."""
    return torch.nn.functional.linear(x, w)


def linear_invariant(x: Tensor, w: Tensor, invariant: bool = False) -> Tensor:
    """The native batch-invariant kernel (float32, AVX2; see ``kernel_build.py``); BLAS for prefills
    (more than ``PREFILL_ROWS`` rows) unless ``invariant`` insists."""
    if x.shape[0] > PREFILL_ROWS and not invariant:
        return torch.nn.functional.linear(x, w)
    return kernel_build.load().linear_rows(x.contiguous(), w)


def linear_int8_invariant(x: Tensor, w: "Int8Rows", invariant: bool = False) -> Tensor:
    """``x @ w.dequantize().T`` for an int8 target: the native kernel widens the weights on the
    fly (invariant for every row count); a prefill dequantizes the matrix and takes BLAS, like
    ``linear_invariant``. Without the native kernel, the portable invariant path on the dequantized
    weights (exact, slow)."""
    if x.shape[0] > PREFILL_ROWS and not invariant:
        return torch.nn.functional.linear(x, w.dequantize())
    kernel = kernel_build.load()
    if kernel is None:
        return linear_invariant_portable(x, w.dequantize(), invariant)
    return kernel.linear_rows_int8(x.contiguous(), w.q, w.scale)


def linear_gguf(x: Tensor, w: "GGUFLinear", invariant: bool = False, *, norm: Tensor | None = None,
                eps: float = 0.0, glu: bool = False, residual: Tensor | None = None) -> Tensor:
    """``x @ w.T`` for GGUF-quantized weights run as shipped (``csrc/linear_gguf.cpp``): every
    row count, prefills included, takes the same integer kernel, so ``invariant`` holds anyway.

    Fused in the same call, row by row: ``norm`` (RMS-normalize x with these weights and ``eps``
    first), ``glu`` (x is gate|up: multiply silu(gate) * up) and ``residual`` (added to the result).
    """
    pre = 1 if norm is not None else 2 if glu else 0
    return kernel_build.load_gguf().linear_gguf(x.float().contiguous(), w.args, pre, norm, eps, residual)


def attention_rows(q: Tensor, k: Tensor, v: Tensor, start: int, scale: float) -> Tensor:
    """Causal grouped-query attention of rows at cache slots ``start..`` (``csrc/attention_rows.cpp``):
    row i sees keys 0..start+i of ``k``/``v`` [kv_heads, capacity, d], which already hold the rows'
    own. Each row is computed alone in a fixed order, so it is batch-invariant by construction.
    q: [N, Hq, d] -> [N, Hq*d]."""
    return kernel_build.load_attention().attention_rows(q.contiguous(), k, v, start, scale)


def rope_qkv(qkv: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, hq: int, hkv: int) -> Tensor:
    """``qkv + bias`` with ``apply_rope`` on its q and k heads, in one native call with the same
    bits (``csrc/attention_rows.cpp``). qkv: [N, (hq + 2 hkv) d]; cos/sin: [N, d]."""
    return kernel_build.load_attention().rope_qkv(qkv, bias, cos.contiguous(), sin.contiguous(), hq, hkv)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: [N, D]. Per-row reduction; computed in float32 like the reference implementations."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_fast(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rms_norm`` as one fused op, for draft models (no invariance needed)."""
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


def rope_tables(head_dim: int, theta: float, max_pos: int) -> tuple[Tensor, Tensor]:
    """cos/sin tables [max_pos, head_dim] in the rotate-half layout used by HF checkpoints."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.int64).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [N, heads, head_dim]; cos/sin: [N, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """Grouped-query attention, blocked over keys for batch invariance.

    q: [kv_heads, G*N, d] (query rows grouped by their kv head), k/v: [kv_heads, L, d],
    bias: [G*N, L] additive mask (0 or -inf). Returns [kv_heads, G*N, d].
    Each row's softmax is exact per row; the weighted sum over keys accumulates fixed blocks of
    ``KEY_BLOCK`` keys in order, so keys a row cannot see add exact zeros and nothing else.
    """
    rows = q.shape[1]
    if rows < MIN_GEMM_ROWS:  # keep BLAS on its GEMM path (see module docstring)
        return attention(_pad_rows(q, 1), k, v, _pad_rows(bias, 0), scale)[:, :rows]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale + bias  # [kv_heads, G*N, L]
    probs = torch.softmax(scores, dim=-1)
    length = k.shape[1]
    out = torch.matmul(probs[:, :, :KEY_BLOCK], v[:, :KEY_BLOCK])
    for start in range(KEY_BLOCK, length, KEY_BLOCK):
        out += torch.matmul(probs[:, :, start : start + KEY_BLOCK], v[:, start : start + KEY_BLOCK])
    return out
