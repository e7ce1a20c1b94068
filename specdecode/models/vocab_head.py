"""An LM head cut down to some of its rows: the logits of a chosen subset of the vocabulary.

A small draft model's LM head is a large share of what one draft step reads (the 0.5B Qwen
draft's tied 151936 x 896 head is about a quarter of its int4 bytes), yet the target writes
mostly a few thousand tokens. Computing only the rows of the tokens a draft is likely to
propose cuts that share by the fraction left out; the target verifies every draft, so the
output is unchanged (FR-Spec, VocabTrim).

``restrict_rows`` slices one matrix in whatever form a decoder holds it, row by row as stored,
so each kept row computes exactly what it computed in the full matrix: the restricted logits
are the full logits' columns at ``ids`` (bitwise where the kernel computes rows independently).
The model knows nothing of drafting; a drafter maps subset indices back to token ids.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from specdecode.errors import InvalidConfigError
from specdecode.models.draft_quant import FbgemmInt8, Int4Groups
from specdecode.models.gguf_planes import GGUFLinear, GGUFWeight
from specdecode.models.int8_rows import Int8Rows
from specdecode.models.weights import LinearWeight


def check_ids(ids: Tensor, rows: int) -> Tensor:
    """``ids`` as a 1-D int64 tensor of distinct rows of a matrix with ``rows`` rows, or a named error."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise InvalidConfigError("a restricted vocabulary needs at least one token id")
    if int(ids.min()) < 0 or int(ids.max()) >= rows:
        raise InvalidConfigError(f"vocabulary ids must lie in [0, {rows}), got {int(ids.min())}..{int(ids.max())}")
    if torch.unique(ids).numel() != ids.numel():
        raise InvalidConfigError("vocabulary ids must be distinct")
    return ids


def restrict_rows(w: LinearWeight, ids: Tensor) -> LinearWeight:
    """The rows ``ids`` [N] of the matrix ``w`` [out, in], in the same form: float, per-row int8,
    fbgemm's prepacked int8, ``Int4Groups`` (its many-rows copy too) or a one-part GGUF weight."""
    if isinstance(w, Tensor):
        return w[ids].contiguous()
    if isinstance(w, Int8Rows):
        return Int8Rows(w.q[ids].contiguous(), w.scale[ids].contiguous())
    if isinstance(w, Int4Groups):
        return Int4Groups(w.packed[ids].contiguous(), w.scales[ids].contiguous(), w.offset[ids].contiguous(),
                          restrict_rows(w.int8, ids), w.kernel)
    if isinstance(w, GGUFLinear):
        if len(w.parts) != 1:
            raise InvalidConfigError("only a one-part GGUF matrix (an LM head) can be restricted to some rows")
        return GGUFLinear((_gguf_rows(w.parts[0], ids),))
    if isinstance(w, FbgemmInt8):
        return _fbgemm_rows(w, ids)
    raise InvalidConfigError(f"cannot restrict a {type(w).__name__} weight to some rows")


def _gguf_rows(w: GGUFWeight, ids: Tensor) -> GGUFWeight:
    """Whole rows of blocks: every plane is laid out [out, ...], an absent one is empty."""
    planes = tuple(p[ids].contiguous() if p.numel() else p for p in w.planes)
    return GGUFWeight(w.type_id, ids.numel(), w.inp, planes)


def _fbgemm_rows(w: FbgemmInt8, ids: Tensor) -> FbgemmInt8:
    """Unpack, keep the rows with their per-channel scales (values unchanged), prepack again."""
    with warnings.catch_warnings():  # quantized tensors are deprecated API, but fbgemm is current
        warnings.simplefilter("ignore")
        q, bias = torch.ops.quantized.linear_unpack(w)
        rows = torch._make_per_channel_quantized_tensor(
            q.int_repr()[ids].contiguous(), q.q_per_channel_scales()[ids].contiguous(),
            q.q_per_channel_zero_points()[ids].contiguous(), 0)
        return torch.ops.quantized.linear_prepack(rows, None if bias is None else bias[ids].contiguous())
