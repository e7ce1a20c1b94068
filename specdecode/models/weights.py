"""What a decoder's tensors are, named by type: which forms a linear weight can take, a layer's
weights, and every tensor one forward reads.

The same decoder runs float weights, a target's per-row int8 (``Int8Rows``), a draft's packed
int8 or int4 (``draft_quant.DraftWeight``) and GGUF k-quants as shipped (``GGUFLinear``); which
one a model holds follows from its backend (``backends.py``), chosen once when it is built. The
union below says so, where a bare ``Tensor`` annotation would not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from specdecode.models import kernels
from specdecode.models.config import ModelConfig
from specdecode.models.draft_quant import DraftWeight
from specdecode.models.gguf_planes import GGUFLinear, GGUFWeight
from specdecode.models.int8_rows import Int8Rows

LinearWeight = Tensor | Int8Rows | DraftWeight | GGUFLinear  # [out, in] in one of its backends' forms
Embedding = Tensor | GGUFWeight  # [V, D]: a float table, or GGUF rows decoded on lookup
Packed = dict[str, Tensor | GGUFWeight | GGUFLinear]  # ``packed.pack`` or ``gguf_load.decoder_weights``


@dataclass(slots=True)
class LayerWeights:
    in_norm: Tensor  # [D]
    qkv: LinearWeight  # [(H + 2*Hkv) * d, D]
    qkv_bias: Tensor | None  # [(H + 2*Hkv) * d]
    o: LinearWeight  # [D, H*d]
    post_norm: Tensor  # [D]
    gate_up: LinearWeight  # [2*I, D]
    down: LinearWeight  # [D, I]


@dataclass(frozen=True, slots=True)
class DecoderWeights:
    """Every tensor one forward reads, the RoPE tables included; ``dtype`` is the activations'
    (and the float weights')."""

    dtype: torch.dtype
    embed: Embedding
    lm_head: LinearWeight  # [V, D]; the embedding itself when tied
    norm: Tensor  # [D]
    layers: list[LayerWeights]
    cos: Tensor  # [positions, d], in ``dtype``: HF also rotates in the model dtype
    sin: Tensor

    @classmethod
    def from_packed(cls, packed: Packed, config: ModelConfig, dtype: torch.dtype) -> "DecoderWeights":
        """The compute-layout tensors ``packed`` (fused q|k|v and gate|up) as a decoder reads them."""
        embed = packed["embed"]
        layers = [LayerWeights(**{f: packed.get(f"layers.{i}.{f}") for f in LayerWeights.__slots__})
                  for i in range(config.num_layers)]
        cos, sin = kernels.rope_tables(
            config.head_dim, config.rope_theta, config.max_position_embeddings + kernels.KEY_BLOCK
        )
        return cls(dtype, embed, packed.get("lm_head", embed), packed["norm"], layers, cos.to(dtype), sin.to(dtype))

    def map_linear(self, convert: Callable[[LinearWeight], LinearWeight]) -> "DecoderWeights":
        """These weights with every matrix (the LM head, then each layer's four) converted."""
        lm_head = convert(self.lm_head)
        layers = []
        for w in self.layers:
            qkv, o = convert(w.qkv), convert(w.o)
            gate_up, down = convert(w.gate_up), convert(w.down)
            layers.append(replace(w, qkv=qkv, o=o, gate_up=gate_up, down=down))
        return replace(self, lm_head=lm_head, layers=layers)
