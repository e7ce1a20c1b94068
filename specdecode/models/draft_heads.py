"""Trained heads (EAGLE, Medusa) in their drafting form: every ``nn.Linear`` packed for speed.

A head's one-token steps read every weight once, so bytes decide their cost, as for a draft
model (``draft_quant.py``); the training form (float32, and shared with the checkpoint) stays as
it is, so the drafting form is a copy, made once per head object and shared by every drafter of
it (one per concurrent request).
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import Tensor

from specdecode.models.draft_quant import linear_draft, pack_int4


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
    Made once per head object; a head whose weights change afterwards must be a new object.
    Without fbgemm the head drafts in float."""
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
