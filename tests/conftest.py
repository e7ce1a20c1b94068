"""Shared fixtures: tiny random-weight models in HF format, built with transformers as the oracle."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Tests that damage caches on purpose must not race a background hash of them (test_cache_watch.py
# runs its own watches); set before specdecode makes the process's watch.
os.environ["SPECDECODE_CACHE_WATCH"] = "0"

from specdecode import LLM  # noqa: E402
from specdecode.config import SpecConfig
from specdecode.engine.costs import StepCosts, StepTimes
from specdecode.engine import policy
from tests.methods import tiny_heads

# Where converted real models live (reused across runs); tests otherwise get a private home so
# packed-weight caches of temporary tiny models never pile up in the user's cache.
REAL_HOME = Path(os.environ.get("SPECDECODE_HOME") or Path.home() / ".cache" / "specdecode")


@pytest.fixture(autouse=True, scope="session")
def private_specdecode_home(tmp_path_factory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("specdecode-home")
    old = os.environ.get("SPECDECODE_HOME")
    os.environ["SPECDECODE_HOME"] = str(home)
    # The compiled kernel depends only on its source and torch: build it once, share it.
    os.environ.setdefault("SPECDECODE_KERNELS", str(REAL_HOME / "kernels"))
    yield home
    if old is None:
        os.environ.pop("SPECDECODE_HOME", None)
    else:
        os.environ["SPECDECODE_HOME"] = old


@pytest.fixture(scope="module")
def real_home() -> Iterator[Path]:
    """Point SPECDECODE_HOME at the real cache while a module of slow tests loads real models."""
    saved = os.environ["SPECDECODE_HOME"]
    os.environ["SPECDECODE_HOME"] = str(REAL_HOME)
    yield REAL_HOME
    os.environ["SPECDECODE_HOME"] = saved

TINY_CONFIGS = {
    "llama": dict(model_type="llama", attention_bias=False, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, sliding_window=None),
}


def make_tiny_model(path: Path, arch: str, vocab_size: int = 96, seed: int = 0, noise: float = 0.0,
                    **overrides) -> Path:
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
            p.mul_(2.0 if p.dim() == 2 else 1.0)
            if noise:  # a perturbed copy of the same seed makes a draft that is often right
                p.add_(torch.randn_like(p) * noise * p.std())
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch, seed=i) for i, arch in enumerate(TINY_CONFIGS)}


TINY_VOCAB = 260  # 256 byte tokens + <eos> + 3 unused ids (embedding rows may exceed the tokenizer)
EOS_ID = 256


def make_tiny_tokenizer(path: Path) -> None:
    """A byte-level BPE without merges: every byte is a token, so any text round-trips."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    assert tok.token_to_id("<eos>") == EOS_ID
    tok.save(str(path / "tokenizer.json"))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": template}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))


def make_tiny_llm(path: Path, arch: str = "llama", seed: int = 0, noise: float = 0.0, **overrides) -> Path:
    make_tiny_model(path, arch, vocab_size=TINY_VOCAB, seed=seed, noise=noise, **overrides)
    make_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target and a tiny draft of the same vocabulary (different weights)."""
    root = tmp_path_factory.mktemp("pair")
    # Untied heads: with tied embeddings a random model mostly repeats its last token.
    target = make_tiny_llm(root / "target", "qwen2", seed=10, tie_word_embeddings=False)
    draft = make_tiny_llm(root / "draft", "qwen2", seed=10, noise=0.1, tie_word_embeddings=False)
    return target, draft


@pytest.fixture(scope="session")
def tiny_pair_heads(tiny_pair, tmp_path_factory) -> dict[str, str]:
    """``LLM`` keywords that give tiny_pair's target a head for every registered method that needs
    one (tests/methods.py), so tests that build an ``LLM`` on the pair run every method."""
    target, _ = tiny_pair
    return tiny_heads(LLM(model=str(target), max_seq_len=64, progress=False), tmp_path_factory.mktemp("heads"))


class CostTable(StepCosts):
    """Costs the policy plans on and never re-measures: a CPU's shape (an extra verify row a
    quarter of a step, a drafted token a fifth of one), not a tiny model's, whose draft is as
    dear as its target, so its policy would rightly draft nothing and an identity test on it
    prove nothing. Acceptance is still learned, so K still changes from step to step."""

    def __init__(self) -> None:
        super().__init__(step_s=0.040, row_share=0.25)

    def draft_token(self, request) -> float:
        return 0.2 * self.verify(1)

    def record(self, step: StepTimes) -> None:
        """Nothing: the table stands."""


@pytest.fixture(autouse=True, scope="session")
def policies_plan_on_the_cost_table() -> Iterator[None]:
    """Every engine the tests build plans on ``CostTable``. On costs measured while running, a
    tiny model's drafts pay or not with how busy the host is, so a test that needs drafts (an
    identity test that checks some were drafted and kept) would pass or fail with the load.
    Tests of measuring build their own ``CostModel(StepCosts())``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(policy, "StepCosts", CostTable)
        yield


@pytest.fixture
def gguf_reads_from_memory(monkeypatch) -> None:
    """gguf's ``GGUFReader`` parses a file from its bytes in memory instead of an ``np.memmap``:
    the same values, about 4x sooner for a tokenizer's 455k metadata fields, each of which costs
    a memmap slice a Python ``__array_finalize__`` call (40 s against 10 s for the Qwen GGUF).
    For the tests that load GGUF files through transformers, their oracle."""
    import types

    import numpy as np
    from gguf import gguf_reader

    in_memory = types.SimpleNamespace(**vars(np))
    in_memory.memmap = lambda path, mode="r": np.fromfile(path, dtype=np.uint8)
    monkeypatch.setattr(gguf_reader, "np", in_memory)


def spec_k(k: int, adaptive: bool = True) -> SpecConfig:
    """Speculative settings with K = ``k``, for tests that drive ``Engine`` directly."""
    return SpecConfig(num_speculative_tokens=k, adaptive=adaptive)
