"""The decoder's compute layout, cached on disk so later loads are a memory map, not a copy.

The decoder fuses q|k|v and gate|up into one ``[out, in]`` matrix each, so a layer runs four
linear calls; the lm_head of a tied model is the embedding itself. Building the fused matrices
copies most of the weights (several seconds for the 1.5B model here); memory-mapping the cached
result takes well under a second and keeps only one copy of the weights in RAM.
The cache lives under ``$SPECDECODE_HOME/packed/`` keyed by the checkpoint's path, size, mtime
and dtype, so a changed checkpoint is repacked, and is written atomically with its size and hash
recorded beside it (``checks``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from specdecode.errors import UnsupportedModelError, WeightsMissingError
from specdecode.files import atomic_path, remove_stale_partials, specdecode_home
from specdecode.models import checks
from specdecode.models.config import ModelConfig
from specdecode.models.watch import WATCH

log = logging.getLogger(__name__)

PACK_VERSION = 2


def load_packed(path: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, Tensor]:
    """Packed weights for the checkpoint in ``path``: from the cache, or packed now and cached
    (memory-mapped, and hashed in the background by ``watch``)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise WeightsMissingError(f"no *.safetensors files in {path}")
    cached = _cache_file(files, dtype)
    weights = _cached_or_packed(files, cached, path, config, dtype)
    if cached.is_file():
        WATCH.watch(cached, lambda dest: _write_atomic(dest, pack(_read_all(files), config, dtype)))
    return weights


def _cached_or_packed(files: list[Path], cached: Path, path: Path, config: ModelConfig,
                      dtype: torch.dtype) -> dict[str, Tensor]:
    crashed = bool(remove_stale_partials(cached.parent))  # a 7 GB .partial of a killed run, say
    if cached.exists():
        try:
            if not checks.intact(cached, full=crashed, progress=True):
                raise ValueError("its size or checksum differs from the record")
            return _read(cached)
        except Exception as exc:  # noqa: BLE001 - truncated or garbage: a derived file, so rebuild it
            log.warning(f"specdecode: the packed cache {cached.name} is damaged ({str(exc)[:80]}); rebuilding it")
            checks.remove_with_sidecar(cached)
    weights = _read_all(files)
    config.check_layers(weights, path)
    packed = pack(weights, config, dtype)
    try:
        _write_atomic(cached, packed)
    except OSError as exc:  # a read-only home must not stop generation, only slow the next load
        log.warning(f"specdecode: could not cache packed weights ({exc.strerror}); continuing")
        return packed
    del packed
    return _read(cached)  # memory-mapped: the packed copy in RAM is released


def pack(weights: dict[str, Tensor], config: ModelConfig, dtype: torch.dtype) -> dict[str, Tensor]:
    """HF checkpoint tensors -> flat dict of compute-layout tensors (see module docstring)."""
    if not config.tie_word_embeddings and "lm_head.weight" not in weights:
        raise UnsupportedModelError("checkpoint has untied embeddings but no lm_head.weight")
    out = {
        "embed": weights["model.embed_tokens.weight"].to(dtype).contiguous(),
        "norm": weights["model.norm.weight"].to(dtype).contiguous(),
    }
    if "lm_head.weight" in weights and not config.tie_word_embeddings:
        out["lm_head"] = weights["lm_head.weight"].to(dtype).contiguous()
    for i in range(config.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        q = f"layers.{i}."
        out[q + "in_norm"] = weights[p + "input_layernorm.weight"].to(dtype).contiguous()
        out[q + "post_norm"] = weights[p + "post_attention_layernorm.weight"].to(dtype).contiguous()
        out[q + "qkv"] = _fuse([weights[f"{a}{n}_proj.weight"] for n in "qkv"], dtype)
        if f"{a}q_proj.bias" in weights:
            out[q + "qkv_bias"] = torch.cat([weights[f"{a}{n}_proj.bias"] for n in "qkv"]).to(dtype)
        out[q + "o"] = _fuse([weights[a + "o_proj.weight"]], dtype)
        out[q + "gate_up"] = _fuse([weights[m + "gate_proj.weight"], weights[m + "up_proj.weight"]], dtype)
        out[q + "down"] = _fuse([weights[m + "down_proj.weight"]], dtype)
    return out


def _fuse(parts: list[Tensor], dtype: torch.dtype) -> Tensor:
    """Stack ``[out_i, in]`` matrices into one contiguous ``[sum out_i, in]`` matrix."""
    return torch.cat([w.to(dtype) for w in parts]).contiguous()


def _cache_file(files: list[Path], dtype: torch.dtype) -> Path:
    key = json.dumps([PACK_VERSION, str(dtype)] + [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
                                                   for f in files])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return specdecode_home() / "packed" / f"{files[0].parent.name}-{digest}.safetensors"


def _read(file: Path) -> dict[str, Tensor]:
    with safe_open(file, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _read_all(files: list[Path]) -> dict[str, Tensor]:
    weights: dict[str, Tensor] = {}
    for file in files:
        weights.update(_read(file))
    return weights


def _write_atomic(target: Path, tensors: dict[str, Tensor]) -> None:
    with atomic_path(target, sync=False) as tmp:  # a cache: checked against its record, else repacked
        save_file(tensors, str(tmp), metadata={"pack_version": str(PACK_VERSION)})
        checks.write_sidecar(target, checks.hash_file(tmp))
