"""A draft model that can learn: the Llama-family decoder in plain, differentiable torch, with LoRA
adapters on its linear layers.

``models.decoder.Decoder`` is built for inference (packed, fused and quantized weights, a KV
cache, no autograd), so DistillSpec trains this twin instead and merges the result back into an
ordinary HF folder that ``Decoder`` loads and quantizes like any draft.

Why LoRA rather than a full fine-tune: on a CPU budget the frozen base costs only activations'
gradients, AdamW keeps state for ~1% of the weights instead of 3x the model (6 GB for the 0.5B
draft), and the checkpoint holds only the adapters (``state_dict`` skips the frozen base, which
is registered as non-persistent buffers), so a checkpoint every two minutes is cheap.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.heads.folders import read_weights
from specdecode.models import kernels
from specdecode.models.config import ModelConfig

ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """``W x + b + (alpha / r) B A x`` with ``W``, ``b`` frozen; ``B`` starts at zero, so the
    adapted layer starts as the base layer."""

    def __init__(self, weight: Tensor, bias: Tensor | None, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        out_features, in_features = weight.shape
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.lora_a = nn.Parameter(torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale

    @torch.no_grad()
    def merged(self) -> Tensor:
        """The base weight with the adapter folded in."""
        return self.weight + (self.lora_b @ self.lora_a) * self.scale


class Student(nn.Module):
    """The decoder of ``config`` over HF-named float ``weights``; ``forward(tokens) -> logits``
    for one whole sequence (training sees whole sequences, so there is no cache)."""

    def __init__(self, config: ModelConfig, weights: dict[str, Tensor], rank: int = 16, alpha: float = 32.0,
                 seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.rank, self.alpha = rank, alpha
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("embed", weights["model.embed_tokens.weight"].float(), persistent=False)
        self.register_buffer("norm", weights["model.norm.weight"].float(), persistent=False)
        head = weights.get("lm_head.weight")
        self.register_buffer("lm_head", self.embed if config.tie_word_embeddings or head is None else head.float(),
                             persistent=False)
        self.adapters = nn.ModuleDict()
        for i in range(config.num_layers):
            for name in ADAPTED:
                group = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                key = f"model.layers.{i}.{group}.{name}"
                bias = weights.get(key + ".bias")
                self.adapters[_module_key(key)] = LoRALinear(weights[key + ".weight"].float(),
                                                             None if bias is None else bias.float(),
                                                             rank, alpha, generator)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                key = f"model.layers.{i}.{norm}.weight"
                self.register_buffer(_module_key(key), weights[key].float(), persistent=False)
        cos, sin = kernels.rope_tables(config.head_dim, config.rope_theta, config.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def from_dir(cls, path: Path, rank: int = 16, alpha: float = 32.0, seed: int = 0) -> "Student":
        """The model in HF folder ``path``; a folder converted from GGUF is dequantized to its
        float32 ``model.safetensors`` first (once, cached beside it)."""
        from specdecode.models.gguf_convert import MARKER_NAME, write_float_weights

        path = Path(path)
        if (path / MARKER_NAME).is_file():
            write_float_weights(path)
        return cls(ModelConfig.from_dir(path), read_weights(path), rank, alpha, seed)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits [T, V] of every position of ``tokens`` [T]."""
        cfg = self.config
        t = tokens.shape[0]
        x = self.embed[tokens]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for i in range(cfg.num_layers):
            layer = f"model.layers.{i}."
            h = _rms_norm(x, getattr(self, _module_key(layer + "input_layernorm.weight")), cfg.rms_norm_eps)
            attn = self._adapter(layer + "self_attn.")
            q = kernels.apply_rope(attn("q_proj")(h).view(t, cfg.num_heads, cfg.head_dim), cos, sin)
            k = kernels.apply_rope(attn("k_proj")(h).view(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = attn("v_proj")(h).view(t, cfg.num_kv_heads, cfg.head_dim)
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 is_causal=True, enable_gqa=cfg.num_kv_heads != cfg.num_heads)
            x = x + attn("o_proj")(out.transpose(0, 1).reshape(t, cfg.num_heads * cfg.head_dim))
            h = _rms_norm(x, getattr(self, _module_key(layer + "post_attention_layernorm.weight")), cfg.rms_norm_eps)
            mlp = self._adapter(layer + "mlp.")
            x = x + mlp("down_proj")(F.silu(mlp("gate_proj")(h)) * mlp("up_proj")(h))
        return F.linear(_rms_norm(x, self.norm, cfg.rms_norm_eps), self.lm_head)

    def _adapter(self, prefix: str):
        return lambda name: self.adapters[_module_key(prefix + name)]

    @torch.no_grad()
    def merged_weights(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
        """HF-named weights with every adapter folded in: what a draft folder holds."""
        cfg = self.config
        out = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head
        for key, module in self.adapters.items():
            name = _hf_key(key)
            out[name + ".weight"] = module.merged()
            if module.bias is not None:
                out[name + ".bias"] = module.bias
        for i in range(cfg.num_layers):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                key = f"model.layers.{i}.{norm}.weight"
                out[key] = getattr(self, _module_key(key))
        return {name: t.to(dtype).contiguous() for name, t in out.items()}


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _module_key(hf_name: str) -> str:
    """Module and buffer names may not contain dots."""
    return hf_name.replace(".", "__")


def _hf_key(module_key: str) -> str:
    return module_key.replace("__", ".")
