"""Medusa head folders: vLLM's layout (``model_type: "medusa"``), and FasterDecoding's original
checkpoints read too.

vLLM's config names ``num_heads`` and ``num_hidden_layers`` (blocks per head) and reads the
blocks' biases only with ``medusa_fc_bias: true``, so it is always written (our blocks have
biases, as the original Medusa's do); a truncated vocabulary is ``truncated_vocab_size`` plus a
``token_map`` tensor of target ids. FasterDecoding's checkpoints (``medusa_num_heads``, keys
``{k}.{j}.linear.weight`` and ``{k}.{L}.weight``) are mapped to the same names on load. vLLM
builds exactly ``num_speculative_tokens`` heads, so K must not exceed ``num_heads`` there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from specdecode.errors import CheckpointError, HeadMismatchError, UnsupportedModelError
from specdecode.heads.folders import read_config, read_weights, write_head
from specdecode.heads.medusa import MedusaConfig, MedusaHeads
from specdecode.models.config import ModelConfig, config_fingerprint

_ORIGINAL_BLOCK = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.linear\.(weight|bias)$")
_ORIGINAL_HEAD = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.weight$")


def save_medusa(heads: MedusaHeads, out: Path, *, target_name: str = "", target_fingerprint: str = "",
                extra: dict[str, Any] | None = None, readme: str | None = None) -> Path:
    cfg = heads.config
    config = {
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
        "truncated_vocab_size": cfg.draft_vocab_size, "medusa_fc_bias": True, "original_lm_head": False,
        "specdecode": {"target": target_name, "target_fingerprint": target_fingerprint, **(extra or {})},
    }
    weights = {k: v.detach().contiguous() for k, v in heads.state_dict().items()}
    return write_head(Path(out), weights, config, readme)


def load_medusa(folder: Path) -> tuple[MedusaHeads, dict[str, Any]]:
    folder = Path(folder)
    config = read_config(folder)
    if config.get("model_type") != "medusa" and "medusa_num_heads" not in config:
        raise UnsupportedModelError(f"{folder}: not a Medusa head folder (model_type {config.get('model_type')!r})")
    weights = _vllm_names(read_weights(folder))
    try:
        num_heads = int(config.get("num_heads") or config["medusa_num_heads"])
        layers = int(config.get("num_hidden_layers") or config.get("medusa_num_layers") or 1)
        hidden = int(config["hidden_size"]) if "hidden_size" in config else int(weights["lm_heads.0.weight"].shape[1])
        vocab = int(config["vocab_size"]) if "vocab_size" in config else int(weights["lm_heads.0.weight"].shape[0])
        truncated = config.get("truncated_vocab_size")
        cfg = MedusaConfig(hidden, vocab, num_heads, layers, None if truncated in (None, vocab) else int(truncated))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder}/config.json does not describe Medusa heads: {exc}") from None
    heads = MedusaHeads(cfg)
    state = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    if "token_map" not in state:
        state["token_map"] = heads.token_map.clone()
    for k in range(cfg.num_heads):  # heads saved without biases (vLLM's default) have zero biases
        for j in range(cfg.num_layers):
            state.setdefault(f"blocks.{k}.layers.{j}.bias", torch.zeros(cfg.hidden_size))
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{folder}: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}; "
                              "are these Medusa heads?")
    return heads, config.get("specdecode") or {}


def load_medusa_for(folder: str | Path, target: ModelConfig, target_dir: Path) -> MedusaHeads:
    """The heads in ``folder``, checked to fit the target in ``target_dir``."""
    heads, ours = load_medusa(Path(folder))
    cfg, problems = heads.config, []
    fingerprint = config_fingerprint(target_dir)
    if ours.get("target_fingerprint") and ours["target_fingerprint"] != fingerprint:
        problems.append(f"they were trained for {ours.get('target') or 'another model'} "
                        f"(fingerprint {ours['target_fingerprint']}, this target's is {fingerprint})")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"their vocabulary has {cfg.vocab_size} tokens, the target's {target.vocab_size}")
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"they read states of width {cfg.hidden_size}, the target's are {target.hidden_size} wide")
    if problems:
        raise HeadMismatchError(f"the Medusa heads in {folder} do not fit this target: {'; '.join(problems)}. "
                                "Use heads trained for this model (`specdecode train medusa --model ...`)")
    return heads


def _vllm_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FasterDecoding's names (``{k}.{j}.linear.*``, ``{k}.{L}.weight``) to vLLM's; a
    ``medusa_heads.`` prefix dropped."""
    out = {}
    for name, tensor in weights.items():
        name = name.removeprefix("medusa_heads.")
        if m := _ORIGINAL_BLOCK.match(name):
            name = f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"
        elif m := _ORIGINAL_HEAD.match(name):
            name = f"lm_heads.{m[1]}.weight"
        out[name] = tensor
    return out
