"""EAGLE-3 head folders in the two layouts the serving engines load.

- ``specforge``: SpecForge's and the EAGLE code's ``LlamaForCausalLMEagle3`` (SGLang and vLLM
  load it): weights ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, no embedding
  (the target's is used); a Llama config plus ``draft_vocab_size`` and ``target_hidden_size``.
- ``speculators``: vLLM's ``speculators`` format (``speculators_model_type: "eagle3"``): the
  layer's weights under ``layers.0.*``, a ``transformer_layer_config``, and a
  ``speculators_config`` naming the verifier (the target), so ``vllm serve DIR`` finds both.

The two name target layers differently: SpecForge's ``eagle_aux_hidden_state_layer_ids`` are
layer *outputs* (our index - 1), vLLM's are layer *inputs* (our index). Both are written only when
the layers differ from the default, which every engine picks the same. A ``specdecode`` block in
the config records the target's name and fingerprint and our layer indices, and wins when present.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specdecode.errors import CheckpointError, HeadMismatchError, UnsupportedModelError
from specdecode.heads.eagle3 import Eagle3Config, Eagle3Head, default_hidden_layers
from specdecode.heads.folders import read_config, read_weights, write_head
from specdecode.models.config import ModelConfig, config_fingerprint

LAYOUTS = ("specforge", "speculators")
SPECFORGE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# Variants of the layer some engines add; a head that uses any of them is refused, not misread.
_UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def save_eagle3(head: Eagle3Head, out: Path, layout: str = "specforge", *, target_name: str = "",
                target_architecture: str = "llama", target_fingerprint: str = "",
                num_speculative_tokens: int = 5, extra: dict[str, Any] | None = None,
                readme: str | None = None) -> Path:
    """Write ``head`` into the folder ``out`` in ``layout``, file by file (see ``folders``).
    ``target_*`` describe the target (its ``ModelConfig.architecture``); the speculators config
    names it as the verifier and proposes ``num_speculative_tokens`` per step."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    cfg = head.config
    ours = {"target": target_name, "target_fingerprint": target_fingerprint,
            "hidden_layers": list(cfg.hidden_layers), **(extra or {})}
    weights = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    if layout == "specforge":
        config = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(cfg),
                  "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size}
        if cfg.hidden_layers != _default_for(cfg):
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.hidden_layers],
                                      "use_aux_hidden_state": True}
    else:
        weights = {k.replace("midlayer.", "layers.0.", 1): v for k, v in weights.items()}
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": _llama_fields(cfg),
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": (list(cfg.hidden_layers) if cfg.hidden_layers != _default_for(cfg)
                                                 else None),
            **{flag: False for flag in _UNSUPPORTED_FLAGS},
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target_name,
                             "architectures": [HF_ARCHITECTURES.get(target_architecture, "LlamaForCausalLM")]},
            },
        }
    config["specdecode"] = ours

    return write_head(Path(out), weights, config, readme)


def load_eagle3(folder: Path) -> tuple[Eagle3Head, dict[str, Any]]:
    """The head in ``folder`` (either layout) and its ``specdecode`` record ({} for a head made
    elsewhere). Raises ``CheckpointError`` for a missing or unreadable folder."""
    folder = Path(folder)
    config = read_config(folder)
    ours = config.get("specdecode") or {}
    if "speculators_config" in config:
        if config.get("speculators_model_type") != "eagle3":
            raise UnsupportedModelError(f"{folder}: speculators_model_type "
                                        f"{config.get('speculators_model_type')!r} is not an EAGLE-3 head")
        layer = config.get("transformer_layer_config") or {}
        # vLLM reads a missing norm_before_residual as True
        flags = {flag: config.get(flag, flag == "norm_before_residual") for flag in _UNSUPPORTED_FLAGS}
        layers = config.get("eagle_aux_hidden_state_layer_ids")
        prefix = "layers.0."
    else:
        arch = (config.get("architectures") or [""])[0]
        if arch not in SPECFORGE_ARCHITECTURES:
            raise UnsupportedModelError(f"{folder}: architecture {arch!r} is not an EAGLE-3 head "
                                        f"({', '.join(SPECFORGE_ARCHITECTURES)} or a speculators folder)")
        layer = config
        flags = {flag: config.get(flag, False) for flag in _UNSUPPORTED_FLAGS if flag != "norm_output"}
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        layers = None if ids is None else [i + 1 for i in ids]  # SpecForge names layer outputs
        prefix = "midlayer."
    used = [flag for flag, on in flags.items() if on]
    if used:
        raise UnsupportedModelError(f"{folder}: the head uses {', '.join(used)}, a variant not supported here")
    if ours.get("hidden_layers") is not None:
        layers = ours["hidden_layers"]
    try:
        hidden = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        cfg = Eagle3Config(
            hidden_size=hidden,
            intermediate_size=int(layer["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(layer.get("num_key_value_heads", heads)),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(config.get("draft_vocab_size") or layer["vocab_size"]),
            target_hidden_size=int(config.get("target_hidden_size") or hidden),
            hidden_layers=tuple(layers) if layers is not None else (),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(layer.get("rope_theta", 10000.0)),
            max_position_embeddings=int(layer.get("max_position_embeddings", 32768)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder}/config.json does not describe an EAGLE-3 head: {exc}") from None
    weights = read_weights(folder)
    state = {k.replace(prefix, "midlayer.", 1): v for k, v in weights.items() if not k.startswith("embed_tokens.")}
    head = Eagle3Head(cfg)
    if "t2d" not in state and "d2t" in state:  # vLLM does not need t2d; rebuild it from d2t
        state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        state["t2d"][state["d2t"] + torch.arange(cfg.draft_vocab_size)] = True
    if "d2t" not in state:  # a full-vocabulary head
        state["d2t"], state["t2d"] = head.d2t.clone(), head.t2d.clone()
    missing, unexpected = head.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{folder}/model.safetensors: missing {sorted(missing)[:4]}, "
                              f"unexpected {sorted(unexpected)[:4]}; is it an EAGLE-3 head?")
    return head, ours


def load_head_for(folder: str | Path, target: ModelConfig, target_dir: Path) -> Eagle3Head:
    """The head in ``folder``, checked to fit the target in ``target_dir``."""
    head, ours = load_eagle3(Path(folder))
    head = resolve_layers(head, target)
    check_target(head, ours, target, config_fingerprint(target_dir), Path(folder))
    return head


def resolve_layers(head: Eagle3Head, target: ModelConfig) -> Eagle3Head:
    """A head whose config left the target layers unsaid gets the default for ``target``."""
    if head.config.hidden_layers:
        return head
    from dataclasses import replace

    cfg = replace(head.config, hidden_layers=default_hidden_layers(target.num_layers))
    fixed = Eagle3Head(cfg)
    fixed.load_state_dict(head.state_dict())
    return fixed


def check_target(head: Eagle3Head, ours: dict[str, Any], target: ModelConfig, fingerprint: str,
                 folder: Path) -> None:
    """Refuse a head made for another target, with what to do."""
    cfg = head.config
    problems = []
    if ours.get("target_fingerprint") and fingerprint and ours["target_fingerprint"] != fingerprint:
        problems.append(f"it was trained for {ours.get('target') or 'another model'} "
                        f"(fingerprint {ours['target_fingerprint']}, this target's is {fingerprint})")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"its vocabulary has {cfg.vocab_size} tokens, the target's {target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(f"it reads hidden states of width {cfg.target_hidden_size}, the target's are "
                        f"{target.hidden_size} wide")
    if cfg.hidden_layers and max(cfg.hidden_layers) > target.num_layers:
        problems.append(f"it reads layer {max(cfg.hidden_layers)} of a target with {target.num_layers}")
    if problems:
        raise HeadMismatchError(f"the EAGLE head in {folder} does not fit this target: {'; '.join(problems)}. "
                                "Use a head trained for this model (`specdecode train eagle3 --model ...`)")


def _default_for(cfg: Eagle3Config) -> tuple[int, ...]:
    """The default layers of the target the head was made for, inferred from its last layer."""
    return default_hidden_layers(cfg.hidden_layers[-1] + 3) if cfg.hidden_layers else ()


def _llama_fields(cfg: Eagle3Config) -> dict[str, Any]:
    return {
        "model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "num_hidden_layers": 1, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
    }
