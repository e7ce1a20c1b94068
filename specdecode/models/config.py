"""The decoder's architecture parameters, read from a Hugging Face ``config.json``.

One dataclass covers the Llama family (llama, qwen2, mistral): they differ only in whether the
q/k/v projections carry a bias, the RoPE base, and whether the LM head is tied to the embedding.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.errors import InvalidConfigError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
# The compute dtypes and draft quantizations a decoder takes, named here (a leaf the settings in
# ``specdecode/config.py`` and the decoder both read) so that they are listed once.
DTYPES = ("float32", "bfloat16")
DRAFT_MODES = ("int8", "int4")


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Translate HF config keys; refuse features this decoder does not implement."""
        arch = cfg.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModelError(f"rope scaling {rope_type!r} is not supported yet")
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", arch == "mistral"):
            # Exactness within the window is unaffected, but we would attend beyond it.
            if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
                raise UnsupportedModelError("sliding-window attention is not supported yet")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        )

    @classmethod
    def from_dir(cls, path: Path) -> "ModelConfig":
        file = Path(path) / "config.json"
        try:
            return cls.from_hf(json.loads(file.read_text(encoding="utf-8")))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not JSON, a field missing or mistyped
            what = f"no field {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0][:160]
            raise UnsupportedModelError(f"{file} is not a valid model config ({what}); re-download or "
                                        "re-convert the model") from None

    def check_layers(self, names: Iterable[str], source: object) -> None:
        """Refuse weights whose decoder layers are not exactly ``num_layers`` (a config edited or
        mismatched would otherwise run part of the model, or garbage)."""
        found = {int(m[1]) for n in names if (m := _LAYER.match(n))}
        if found != set(range(self.num_layers)):
            have = f"layers 0..{max(found)}" if found else "no layers"
            raise UnsupportedModelError(f"{source} has {have} ({len(found)}) but its config.json says "
                                        f"num_hidden_layers={self.num_layers}; the files do not belong together")


def config_fingerprint(model_dir: Path) -> str:
    """A short hash of a model folder's ``config.json`` bytes: what files derived from a model
    (a skip choice, a trained head) record, so they are not used with another model."""
    try:
        data = (Path(model_dir) / "config.json").read_bytes()
    except OSError as exc:
        raise InvalidConfigError(f"cannot read {model_dir}/config.json: {exc.strerror}") from None
    return hashlib.sha256(data).hexdigest()[:16]
