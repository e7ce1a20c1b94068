"""Random GGUF blocks of every native type, and tiny GGUF models made of them, built with numpy.

gguf-py quantizes only the 32-blocks; k-quant blocks are random bytes with fp16 scales set to
small finite values, which is every block a quantizer could write (any value and scale bits
are legal). ``gguf.quants.dequantize`` stays the independent reference for all of them.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from specdecode.models.gguf_planes import TYPES

# Byte offsets of each type's fp16 fields within its block.
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
NATIVE = list(F16_FIELDS)


def random_blocks(rng: np.random.Generator, type_name: str, out: int, inp: int, scale: float = 0.01) -> np.ndarray:
    """GGUF bytes [out, row bytes] of a random ``type_name`` matrix with weights of about ``scale``."""
    block, size = next((b, s) for n, b, s in TYPES.values() if n == type_name)
    raw = rng.integers(0, 256, size=(out, inp // block, size), dtype=np.uint8)
    per = {"Q4_K": 1 / 30, "Q5_K": 1 / 60, "Q6_K": 1 / 40, "Q8_0": 1 / 64, "Q4_0": 1 / 4, "Q5_0": 1 / 8}.get(type_name, 1 / 8)
    for off in F16_FIELDS[type_name]:
        d = (rng.uniform(0.5, 1.5, size=(out, inp // block)) * scale * per).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(out, inp // block, 2)
    return raw.reshape(out, -1)


def dequantized(raw: np.ndarray, type_name: str, out: int, inp: int) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, getattr(Q, type_name)), dtype=np.float32).reshape(out, inp)


def write_model_gguf(path: Path, types: dict[str, str], hidden: int = 256, inter: int = 512, layers: int = 2,
                     seed: int = 0, tied: bool = False, output_scale: float = 0.3) -> None:
    """A tiny qwen2 GGUF whose matrices have the types ``types`` maps GGUF-name substrings to
    (default Q8_0), with the byte tokenizer of ``test_gguf_convert``. Its logits spread by about
    600 * ``output_scale`` (the default makes greedy choices clear-cut; sampling tests want less)."""
    from tests.test_gguf_convert import CHATML, tiny_vocab

    rng = np.random.default_rng(seed)
    tokens, token_types, merges = tiny_vocab()
    heads, kv_heads = 4, 2
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(layers), w.add_context_length(512), w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter), w.add_head_count(heads), w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("qwen2"), w.add_token_list(tokens)
    w.add_token_types(token_types), w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>")), w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False), w.add_chat_template(CHATML)
    vocab = len(tokens)

    def matrix(name: str, out: int, inp: int, scale: float) -> None:
        type_name = next((t for key, t in types.items() if key in name), "Q8_0")
        raw = random_blocks(rng, type_name, out, inp, scale)
        w.add_tensor(name, raw, raw_dtype=getattr(Q, type_name))

    def vector(name: str, n: int, mean: float = 1.0) -> None:
        w.add_tensor(name, (mean + 0.1 * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden, 1.0)
    if not tied:
        matrix("output.weight", vocab, hidden, output_scale)
    vector("output_norm.weight", hidden)
    for i in range(layers):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", hidden), vector(b + "ffn_norm.weight", hidden)
        matrix(b + "attn_q.weight", heads * head_dim, hidden, 0.15)
        matrix(b + "attn_k.weight", kv_heads * head_dim, hidden, 0.15)
        matrix(b + "attn_v.weight", kv_heads * head_dim, hidden, 0.15)
        for n, size in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            vector(b + f"attn_{n}.bias", size, 0.0)
        matrix(b + "attn_output.weight", hidden, heads * head_dim, 0.15)
        matrix(b + "ffn_gate.weight", inter, hidden, 0.15)
        matrix(b + "ffn_up.weight", inter, hidden, 0.15)
        matrix(b + "ffn_down.weight", hidden, inter, 0.1)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
