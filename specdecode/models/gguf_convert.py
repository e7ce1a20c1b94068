"""Convert a GGUF file (llama / qwen2 / mistral) into a Hugging Face model folder, once.

Why a conversion and not a GGUF loader: dequantizing a 1.5B Q4_K_M model takes a minute and
building its tokenizer from metadata takes seconds more; the model code should instead memory-map
float32 safetensors on every later start. The output is an ordinary HF folder (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json), so transformers
can load it too and serve as a test oracle.

Two details decide correctness:
* llama.cpp's converter permutes the rows of q/k projections for the ``llama`` architecture
  (it stores the rotary halves interleaved); we undo that so HF's rotate-half RoPE is right.
  Qwen2 files are stored unpermuted.
* The tokenizer's pre-tokenizer (how text is cut into words before BPE) is only named in the
  file (``tokenizer.ggml.pre``); the regexes for each name follow llama.cpp's llama-vocab.cpp.

Memory: tensors are dequantized one at a time and streamed into the safetensors file, so peak
memory is one tensor (the embedding), not the whole fp32 model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specdecode.errors import ModelNotFoundError, UnsupportedModelError
from specdecode.files import atomic_path, partial_path, remove_stale_partials, write_folder
from specdecode.models import checks
from specdecode.tokenizer import tokenizer_files_from_gguf

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1
MARKER_NAME = "specdecode_conversion.json"  # written last: its presence means "finished"


@dataclass(frozen=True)
class _Arch:
    hf_class: str
    model_type: str
    permuted_qk: bool  # llama.cpp stored q/k rows interleaved for rotary


_ARCHS = {
    "llama": _Arch("LlamaForCausalLM", "llama", permuted_qk=True),
    # A literal "mistral" GGUF is rare (llama.cpp writes Mistral as "llama"); it would come from
    # the same Llama converter path, so it is treated as permuted as well.
    "mistral": _Arch("MistralForCausalLM", "mistral", permuted_qk=True),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {  # blk.{i}.<key> -> model.layers.{i}.<value>
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
_SUPPORTED_QTYPES = (  # all that gguf.quants can dequantize among the usual llama.cpp types
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)


def read_gguf_metadata(path: Path, include_arrays: bool = False) -> dict[str, Any]:
    """The key/value metadata of a GGUF file; long arrays (the vocabulary) only on request."""
    reader = _open_reader(Path(path))
    return _metadata(reader, include_arrays)


def gguf_sources(folder: Path) -> list[Path]:
    """The GGUF file(s) a converted model folder came from (its conversion marker lists them)."""
    marker = Path(folder) / MARKER_NAME
    try:
        sources = [Path(s) for s in json.loads(marker.read_text())["sources"]]
    except (OSError, ValueError, KeyError):
        raise UnsupportedModelError(f"{folder} was not converted from a GGUF file, so it has no native form; "
                                    "use --quantize none (or int8)") from None
    missing = [s for s in sources if not s.is_file()]
    if missing:
        raise UnsupportedModelError(f"the GGUF source of {folder} is gone ({missing[0]}); reinstall it or use "
                                    "--quantize none")
    return sources


def convert_gguf(gguf_paths: Sequence[Path] | Path, out_dir: Path, progress: bool = True,
                 float_weights: bool = True) -> Path:
    """Convert one GGUF (given whole, or as byte parts to concatenate in order) into ``out_dir``.

    ``float_weights=False`` writes everything but ``model.safetensors`` (a 4-bit model's float32
    copy is 7x its size): a model run natively never reads it, and ``write_float_weights`` makes
    it later for whoever needs floats (``--quantize none``, transformers as a peer).

    Everything is written into a partial folder beside ``out_dir`` and swapped in at the end
    (``files.write_folder``), so ``out_dir`` either holds a complete conversion (with its marker
    file) or does not exist; a killed conversion's folder is removed by the next one.
    """
    parts = [Path(gguf_paths)] if isinstance(gguf_paths, (str, os.PathLike)) else [Path(p) for p in gguf_paths]
    if not parts:
        raise ModelNotFoundError("convert_gguf needs at least one GGUF file")
    for part in parts:
        if not part.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {part}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    joined = out_dir.with_name(f".{out_dir.name}.joined.gguf")
    remove_stale_partials(out_dir.parent)
    _check_disk_space(parts, out_dir.parent)
    started = time.monotonic()

    def write(partial: Path) -> None:
        gguf_file = parts[0] if len(parts) == 1 else join_parts(parts, joined, progress)
        _convert_into(gguf_file, partial, progress, float_weights)
        _write_json(partial / MARKER_NAME, {
            "converter_version": CONVERTER_VERSION, "sources": [str(p) for p in parts],
            "source_bytes": sum(p.stat().st_size for p in parts), "seconds": round(time.monotonic() - started, 1),
            "files": {f.name: checks.hash_file(f).to_json() for f in sorted(partial.glob("*.json"))
                      if not f.name.endswith(".check.json")},  # model.safetensors has its own record
        })

    try:
        write_folder(out_dir, write)
    finally:
        joined.unlink(missing_ok=True)
    return out_dir


def _convert_into(gguf_file: Path, out: Path, progress: bool, float_weights: bool = True) -> None:
    """Write every file of the HF folder from one (whole) GGUF file into ``out``."""
    reader = _open_reader(gguf_file)
    meta = _metadata(reader, include_arrays=True)
    arch_name = str(meta.get("general.architecture"))
    arch = _ARCHS.get(arch_name)
    if arch is None:
        raise UnsupportedModelError(
            f"GGUF architecture {arch_name!r} is not supported; supported: {', '.join(sorted(_ARCHS))}"
        )
    tokenizer_files = tokenizer_files_from_gguf(meta)  # before the slow part: fail fast if unsupported
    tensors = {t.name: t for t in reader.tensors}
    config = build_config(meta, arch_name, tied="output.weight" not in tensors)
    eos_ids = tokenizer_files.generation_config.get("eos_token_id") or [None]
    config.update(eos_token_id=eos_ids[0], bos_token_id=tokenizer_files.generation_config.get("bos_token_id"))
    jobs = _plan_tensors(tensors, config, arch)
    if float_weights:
        checks.write_sidecar(out / "model.safetensors", _write_safetensors(out / "model.safetensors", jobs, progress))
    tokenizer_files.tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_files.tokenizer_config)
    _write_json(out / "generation_config.json", tokenizer_files.generation_config)
    _write_json(out / "config.json", config)


def write_float_weights(folder: Path, progress: bool = True) -> Path:
    """``folder/model.safetensors`` (float32) from the GGUF the folder was converted from, unless
    it is there already and intact (``checks``); written to a temporary name and renamed, so it is
    whole or absent."""
    target = Path(folder) / "model.safetensors"
    crashed = bool(remove_stale_partials(Path(folder)))
    if target.is_file():
        if checks.intact(target, full=crashed, progress=progress):
            return target
        log.warning(f"specdecode: {target} does not match its recorded size or checksum; dequantizing it again")
        checks.remove_with_sidecar(target)
    parts = gguf_sources(Path(folder))
    _check_disk_space(parts, Path(folder))
    joined = partial_path(target, "joined.gguf")
    try:
        with atomic_path(target) as partial:
            gguf_file = parts[0] if len(parts) == 1 else join_parts(parts, joined, progress)
            reader = _open_reader(gguf_file)
            meta = _metadata(reader, include_arrays=False)
            arch_name = str(meta.get("general.architecture"))
            config = json.loads((Path(folder) / "config.json").read_text())
            jobs = _plan_tensors({t.name: t for t in reader.tensors}, config, _ARCHS[arch_name])
            checks.write_sidecar(target, _write_safetensors(partial, jobs, progress))
    finally:
        joined.unlink(missing_ok=True)
    return target


def build_config(meta: dict[str, Any], arch_name: str, tied: bool) -> dict[str, Any]:
    """HF ``config.json`` values from GGUF metadata (keys ``<arch>.*``)."""
    arch = _ARCHS[arch_name]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch_name}.{key}", default)

    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length") or hidden // n_heads)
    rope_dim = get("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise UnsupportedModelError(f"partial rotary embeddings (rope dim {rope_dim} != head dim {head_dim})")
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none") and float(get("rope.scaling.factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"RoPE scaling {scaling!r} in GGUF files is not supported yet")
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or n_heads),
        "head_dim": head_dim,
        "rope_theta": _clean_float(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": _clean_float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch_name == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if arch_name == "mistral":
        config["sliding_window"] = get("attention.sliding_window")
    if arch_name == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None)
    return config


def _clean_float(value: float) -> float:
    """GGUF stores float32: 1e-06 reads back as 9.99999997e-07. Use the shortest float32 repr."""
    return float(str(np.float32(value)))


@dataclass(frozen=True)
class _Job:
    hf_name: str
    tensor: Any  # gguf ReaderTensor
    shape: tuple[int, ...]  # numpy / HF order
    unpermute_heads: int | None  # undo llama.cpp's q/k row interleave with this many heads


def _plan_tensors(tensors: dict[str, Any], config: dict[str, Any], arch: _Arch) -> list[_Job]:
    """Map GGUF tensor names to HF names and check each shape against the config."""
    expected = _expected_shapes(config)
    jobs: list[_Job] = []
    for name, tensor in tensors.items():
        hf_name = _hf_name(name)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        want = expected.get(hf_name)
        if want is not None and len(shape) == 2 and len(want) == 1 and shape[0] == 1:
            shape = shape[1:]  # some writers store 1-D tensors as [1, n]
        if want != shape:
            raise UnsupportedModelError(f"tensor {name} has shape {shape}, expected {want} for {hf_name}")
        _check_qtype(tensor)
        heads = None
        if arch.permuted_qk and ".self_attn.q_proj." in hf_name:
            heads = config["num_attention_heads"]
        elif arch.permuted_qk and ".self_attn.k_proj." in hf_name:
            heads = config["num_key_value_heads"]
        jobs.append(_Job(hf_name, tensor, shape, heads))
    names = {job.hf_name for job in jobs}
    has_bias = arch.model_type == "qwen2"  # Qwen2 has q/k/v biases by architecture; Llama none
    if not has_bias and any(n.endswith(".bias") for n in names):
        raise UnsupportedModelError(f"{arch.model_type} GGUF files with attention biases are not supported")
    skip = {"lm_head.weight"} if config["tie_word_embeddings"] else set()
    missing = [n for n in expected if n not in names and n not in skip and (has_bias or not n.endswith(".bias"))]
    if missing:
        raise UnsupportedModelError(f"GGUF file lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return jobs


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_TENSORS:
        return f"model.layers.{parts[1]}.{_BLOCK_TENSORS[parts[2]]}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no place in a Llama/Qwen2 model")


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h),
    }
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
    }
    for layer in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{layer}.{k}": s for k, s in per_layer.items()})
    return shapes


def _check_qtype(tensor: Any) -> None:
    if tensor.tensor_type.name not in _SUPPORTED_QTYPES:
        supported = ", ".join(_SUPPORTED_QTYPES)
        raise UnsupportedModelError(f"tensor {tensor.name} uses {tensor.tensor_type.name}; supported: {supported}")


def dequantize_tensor(tensor: Any, shape: tuple[int, ...], unpermute_heads: int | None = None) -> np.ndarray:
    """One GGUF tensor as a C-contiguous little-endian float32 array in HF layout."""
    from gguf.quants import dequantize

    array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    if unpermute_heads is not None:
        array = unpermute_qk(array, unpermute_heads)
    return np.ascontiguousarray(array, dtype="<f4")


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``LlamaModel.permute``.

    llama.cpp reshapes each head's rows as (2, head_dim/2) and swaps the axes, interleaving the two
    rotary halves; we view rows as (head_dim/2, 2) and swap back. Works for weights and biases.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise UnsupportedModelError(f"cannot un-permute {rows} rows over {n_heads} heads")
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _write_safetensors(path: Path, jobs: list[_Job], progress: bool) -> checks.Record:
    """Stream tensors into a safetensors file: header first (shapes are known), then data.

    Only one dequantized tensor is alive at a time. Data offsets are multiples of 4 after an
    8-byte aligned header, so the file can be memory-mapped as float32 later.
    """
    from tqdm import tqdm

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for job in jobs:
        size = 4 * int(np.prod(job.shape, dtype=np.int64))
        header[job.hf_name] = {"dtype": "F32", "shape": list(job.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        hashing = checks.HashingWriter(f)
        hashing.write(len(blob).to_bytes(8, "little"))
        hashing.write(blob)
        for job in tqdm(jobs, desc="dequantizing", unit="tensor", file=sys.stderr, disable=not progress):
            array = dequantize_tensor(job.tensor, job.shape, job.unpermute_heads)
            hashing.write(memoryview(array).cast("B"))
            del array
    if path.stat().st_size != 8 + len(blob) + offset:
        raise OSError(f"short write of {path}")
    return hashing.record()


def _open_reader(path: Path) -> Any:
    """A memory-mapped GGUFReader, with a clear error for files that are not GGUF."""
    from gguf import GGUFReader

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UnsupportedModelError(f"{path} is not a GGUF file (magic {magic!r})")
    try:
        return GGUFReader(path)
    except (ValueError, IndexError) as exc:  # truncated or corrupt files
        raise UnsupportedModelError(f"cannot read GGUF file {path}: {exc}") from exc


def _metadata(reader: Any, include_arrays: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not include_arrays and len(field.data) > 64 and len(field.types) > 1:
            continue
        meta[key] = field.contents()
    return meta


def join_parts(parts: list[Path], dest: Path, progress: bool) -> Path:
    """Concatenate byte parts (not gguf-split shards) into one file next to the output."""
    from tqdm import tqdm

    total = sum(p.stat().st_size for p in parts)
    with open(dest, "wb") as out, tqdm(total=total, desc="joining parts", unit="B", unit_scale=True,
                                      file=sys.stderr, disable=not progress) as bar:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(16 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
    return dest


def _check_disk_space(parts: list[Path], folder: Path) -> None:
    """Fail before minutes of work: fp32 output is ~7x a 4-bit GGUF, plus the joined copy."""
    total = sum(p.stat().st_size for p in parts)
    need = total * (8 if len(parts) > 1 else 7)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise OSError(f"not enough disk space in {folder}: {free >> 20} MiB free, need about {need >> 20} MiB")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
