"""A GGUF target's whole forward for its decode and verify rows in one native call
(``GGUFForward``, ``csrc/linear_gguf.cpp``).

Through its Python layers a decode step of the 1.5B target makes some 200 kernel calls, and the
second thread waits while Python runs between them. The native forward runs every layer in one
OpenMP team with the same kernels on the same values in the same order, so a row gets the bits
the layers give it (``tests/test_gguf_forward.py``): plain decoding, verification, a server batch
and a token tree stay token-identical whichever path each call takes. It serves calls of up to
``FUSED_MAX_ROWS`` rows; a prompt takes the layers, whose many-row wide tiles need no such help.
"""

from __future__ import annotations

import torch

from specdecode.models import kernel_build
from specdecode.models.config import ModelConfig
from specdecode.models.gguf_planes import GGUFLinear, GGUFWeight
from specdecode.models.int4_forward import FusedForward
from specdecode.models.weights import DecoderWeights

# Rows per call of the native forward: up to the GGUF kernel's largest row tile (``TMAX``), the
# verify step of K <= 14 drafts. Longer calls are prompts (or a catch-up of a long copy).
FUSED_MAX_ROWS = 15


def _parts(w: object) -> list | None:
    if isinstance(w, GGUFLinear):
        return w.args
    return [w.part] if isinstance(w, GGUFWeight) else None


def fused_gguf(config: ModelConfig, weights: DecoderWeights, isa: str | None = None) -> FusedForward | None:
    """The native whole forward of a decoder whose every matrix runs as GGUF blocks, or None;
    ``isa``: the kernel build (``kernel_build.load_gguf``; default the one models use)."""
    empty = torch.empty(0)
    layers = []
    for w in weights.layers:
        parts = [_parts(m) for m in (w.qkv, w.o, w.gate_up, w.down)]
        if any(p is None for p in parts):
            return None
        bias = w.qkv_bias.float() if w.qkv_bias is not None else empty
        layers.append((w.in_norm.float(), w.post_norm.float(), bias, *parts))
    head = _parts(weights.lm_head)
    if head is None:
        return None
    return kernel_build.load_gguf(isa).GGUFForward(config.num_heads, config.num_kv_heads, config.head_dim,
                                                   config.rms_norm_eps, weights.cos.float(), weights.sin.float(),
                                                   weights.norm.float(), head, layers)
