"""Per-row int8 weights with float activations: how a *target* the user asks to quantize runs.

A target's rows must keep their bits however many share a call (the verify forward runs K+1 rows
where plain decoding runs one), so its int8 form is the simplest one with that property: one
float32 scale per output row, the weights widened to float inside the kernel
(``kernels.linear_int8_invariant``) and the activations left in float. A dynamic int8 linear
(fbgemm, ``draft_quant.py``) shares one activation scale between the rows of a call and would
break identity with plain decoding; drafts may use it, targets may not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

QUANTIZE_MODES = ("int8",)  # for a target


@dataclass(frozen=True, slots=True)
class Int8Rows:
    """An int8 weight [out, in] with one float32 scale per output row (see the module docstring).
    Drafts use it too, as the many-row copy of an int4 weight (``draft_quant.Int4Groups``)."""

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
