"""Damaged model files end in a named error or a rebuilt cache, never in garbage or a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.generation import _check_finite
from specdecode.errors import NonFiniteLogitsError, UnsupportedModelError
from specdecode.files import specdecode_home
from tests.gguf_blocks import write_model_gguf

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _copy(folder: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(folder, dest)
    return dest


def test_nan_weights_raise_instead_of_emitting_token_zero(tiny_pair) -> None:
    llm = LLM(model=str(tiny_pair[0]), max_seq_len=128, progress=False)
    llm.target.norm = llm.target.norm.clone()
    llm.target.norm[3] = float("nan")  # one damaged value reaches every logit
    with pytest.raises(NonFiniteLogitsError, match="damaged"):
        llm.generate("hello", PARAMS)


def test_a_config_with_a_layer_fewer_is_refused(tiny_pair, tmp_path) -> None:
    folder = _copy(tiny_pair[0], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] -= 1
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers=1"):
        LLM(model=str(folder), max_seq_len=128, progress=False)


@pytest.mark.parametrize("text, match", [("{not json", "not valid JSON"),
                                         ('{"model_type": "qwen2"}', "no field"),
                                         ('{"model_type": "qwen2", "num_attention_heads": "x", "hidden_size": 64}',
                                          "not a valid model config")])
def test_a_broken_config_is_a_named_error(tiny_pair, tmp_path, text, match) -> None:
    folder = _copy(tiny_pair[0], tmp_path)
    (folder / "config.json").write_text(text)
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(model=str(folder), max_seq_len=128, progress=False)


def test_a_truncated_packed_cache_is_rebuilt(tiny_pair, tmp_path, caplog) -> None:
    folder = _copy(tiny_pair[0], tmp_path)
    want = LLM(model=str(folder), max_seq_len=128, progress=False).generate("hello", PARAMS)[0].token_ids
    caches = [p for p in (specdecode_home() / "packed").glob("model-*.safetensors")]
    assert caches
    for cache in caches:
        cache.write_bytes(cache.read_bytes()[:1000])
    got = LLM(model=str(folder), max_seq_len=128, progress=False).generate("hello", PARAMS)[0].token_ids
    assert got == want and "damaged" in caplog.text


def test_a_garbage_native_cache_is_repacked(tmp_path, caplog) -> None:
    path = tmp_path / "m.gguf"
    write_model_gguf(path, {"": "Q4_K"}, seed=7)
    want = LLM(model=str(path), max_seq_len=128, progress=False).generate("hi", PARAMS)[0].token_ids
    for cache in (specdecode_home() / "native").glob("m-*.safetensors"):
        cache.write_bytes(b"\x00" * 64)
    got = LLM(model=str(path), max_seq_len=128, progress=False).generate("hi", PARAMS)[0].token_ids
    assert got == want and "repacking" in caplog.text


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_logit_is_refused(bad) -> None:
    logits = torch.randn(3, 1000)
    logits[2, 517] = bad
    with pytest.raises(NonFiniteLogitsError):
        _check_finite(logits)


def test_huge_finite_logits_whose_sum_overflows_pass() -> None:
    logits = torch.zeros(2, 8)
    logits[0, :3] = 3e38  # their sum is inf in float32; each is finite
    _check_finite(logits)
