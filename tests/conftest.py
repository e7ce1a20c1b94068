"""Shared fixtures: tiny random-weight models in HF format, built with transformers as the oracle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_CONFIGS = {
    "llama": dict(model_type="llama", attention_bias=False, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, sliding_window=None),
}


def make_tiny_model(path: Path, arch: str, vocab_size: int = 96, seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of ``arch`` as an HF folder; returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    )
    base.update(TINY_CONFIGS[arch])
    base.update(overrides)
    model_type = base.pop("model_type")
    config = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # random init is near-uniform; sharpen so greedy paths are varied
        for p in model.parameters():
            p.mul_(4.0 if p.dim() == 2 else 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch, seed=i) for i, arch in enumerate(TINY_CONFIGS)}
