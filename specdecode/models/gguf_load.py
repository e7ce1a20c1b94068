"""Load a GGUF model natively: the decoder's weights as ``GGUFWeight`` planes, not float copies.

``native_weights(sources)`` repacks the GGUF once into ``$SPECDECODE_HOME/native/`` (see
``gguf_planes.py``) and memory-maps the result on every later load; ``decoder_weights`` then
arranges them the way ``Decoder`` wants (q|k|v and gate|up as one multi-part linear each). The
tensor names and shapes are checked by the same plan as the float conversion, so both forms
describe the same model.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor

from specdecode.errors import UnsupportedModelError
from specdecode.files import partial_path, remove_stale_partials, specdecode_home
from specdecode.models import checks, draft_quant, gguf_convert, gguf_planes, kernel_build
from specdecode.models.config import ModelConfig
from specdecode.models.gguf_planes import GGUFLinear, GGUFWeight
from specdecode.models.watch import WATCH

log = logging.getLogger(__name__)

NativeWeights = dict[str, "Tensor | GGUFWeight"]
T = TypeVar("T")


def native_weights(sources: Sequence[Path], progress: bool = True) -> NativeWeights:
    """HF-named weights of the GGUF in ``sources`` (one file, or byte parts in order): quantized
    matrices as ``GGUFWeight``, the rest float32. Repacked on first use, then memory-mapped; a cache
    whose size (or, after a crash, checksum) differs from its record is repacked."""
    sources = [Path(s) for s in sources]
    cached = gguf_planes.cache_path(sources, specdecode_home())
    refused = cached.with_suffix(".unsupported")  # remembers why a file cannot run natively
    if refused.is_file():
        raise UnsupportedModelError(refused.read_text())

    def build(dest: Path, progress: bool) -> None:
        try:
            _build(sources, dest, progress)
        except UnsupportedModelError as exc:
            if "--quantize none" in str(exc):  # a property of the file, not of this machine
                refused.write_text(str(exc))
            raise
        _remove_older_versions(sources)

    return cached_file(cached, build, _read, ("repacked cache", "repacking"), progress)


def cached_file(cached: Path, build: Callable[[Path, bool], None], read: Callable[[Path], T],
                what: tuple[str, str], progress: bool = True) -> T:
    """``read(cached)`` of a file derived from a model's source (``build(dest, progress)`` writes it
    with its record, ``checks``): built when absent, rebuilt when its size (or, after a crash, its
    checksum) differs from its record or it does not read, and watched for damage while mapped
    (``WATCH``). ``what``: the file's name and the word for rebuilding it, for the warnings."""
    name, redo = what
    crashed = bool(remove_stale_partials(cached.parent))
    if cached.is_file() and not checks.intact(cached, full=crashed, progress=progress):
        log.warning(f"specdecode: the {name} {cached.name} does not match its recorded size or checksum; {redo}")
        checks.remove_with_sidecar(cached)
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        build(cached, progress)
    try:
        out = read(cached)
    except Exception as exc:  # noqa: BLE001 - truncated or garbage: derived, so rebuild
        log.warning(f"specdecode: the {name} {cached.name} is damaged ({str(exc)[:80]}); {redo}")
        checks.remove_with_sidecar(cached)
        build(cached, progress)
        out = read(cached)
    WATCH.watch(cached, lambda dest: build(dest, False))  # same-size damage: hashed later
    return out


def int4_draft_weights(packed: dict[str, object], sources: Sequence[Path], progress: bool = True) -> dict[str, object]:
    """``packed`` (``decoder_weights`` of the GGUF in ``sources``) with each matrix in the int4
    draft's form (``draft_quant.pack_int4`` of the dequantized GGUF weight, which calls of many rows
    keep running as shipped). Packing the 0.5B draft takes seconds at every start; so it is done
    once into ``$SPECDECODE_HOME/native/`` beside the GGUF's planes and memory-mapped after."""
    cached = gguf_planes.int4_cache_path(sources, specdecode_home())
    matrices = {name: w for name, w in packed.items() if isinstance(w, GGUFLinear)}

    def build(dest: Path, progress: bool) -> None:
        packs: list[str] = []
        gguf_planes.write_atomic(dest, _int4_arrays(matrices, packs, progress),
                                 lambda: {"int4_pack_version": str(gguf_planes.INT4_PACK_VERSION),
                                          "packed": json.dumps(packs)})

    def read(path: Path) -> dict[str, object]:
        kernel = kernel_build.load_int4()
        out = dict(packed)
        with safe_open(path, framework="pt") as f:
            for name in json.loads(f.metadata()["packed"]):
                out[name] = draft_quant.Int4Groups(f.get_tensor(f"{name}.packed"), f.get_tensor(f"{name}.scales"),
                                                   f.get_tensor(f"{name}.offset"), matrices[name],
                                                   kernel.linear_int4 if kernel else None)
        return out

    return cached_file(cached, build, read, ("int4 draft cache", "packing it again"), progress)


def _int4_arrays(matrices: dict[str, GGUFLinear], packs: list[str], progress: bool) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of each matrix's int4 pack, one matrix in memory at a time; the names of those
    packed go into ``packs`` (a matrix whose inputs are not whole int4 groups stays as shipped)."""
    from tqdm import tqdm

    for name, w in tqdm(matrices.items(), desc="packing int4 draft", unit="matrix", file=sys.stderr,
                        disable=not progress):
        groups = draft_quant.pack_int4(w.dequantize(), many_rows=w)
        if not isinstance(groups, draft_quant.Int4Groups):
            continue
        packs.append(name)
        for plane in ("packed", "scales", "offset"):
            yield f"{name}.{plane}", getattr(groups, plane).numpy()


def _remove_older_versions(sources: list[Path]) -> None:
    """Delete the planes earlier repack versions made of ``sources``: a version change repacks, and
    the old cache (a gigabyte for the default target) would stay on disk unused. A process that
    still maps one keeps reading it; the space returns when it exits."""
    home = specdecode_home()
    for version in range(1, gguf_planes.REPACK_VERSION):
        old = gguf_planes.cache_path(sources, home, version)
        if old.is_file():
            log.info(f"specdecode: removing {old.name}, planes of an earlier repack version")
            checks.remove_with_sidecar(old)


def _build(sources: list[Path], cached: Path, progress: bool) -> None:
    joined = partial_path(cached, "joined.gguf")
    try:
        gguf_file = sources[0] if len(sources) == 1 else gguf_convert.join_parts(sources, joined, progress)
        reader = gguf_convert._open_reader(gguf_file)
        meta = gguf_convert._metadata(reader, include_arrays=True)
        arch_name = str(meta.get("general.architecture"))
        arch = gguf_convert._ARCHS.get(arch_name)
        if arch is None:
            raise UnsupportedModelError(f"GGUF architecture {arch_name!r} is not supported")
        tensors = {t.name: t for t in reader.tensors}
        config = gguf_convert.build_config(meta, arch_name, tied="output.weight" not in tensors)
        jobs = gguf_convert._plan_tensors(tensors, config, arch)
        for job in jobs:
            if len(job.shape) == 2:
                gguf_planes.check_type(job.tensor.name, job.tensor.tensor_type.name, job.shape[1])
        records: dict[str, list[object]] = {}
        gguf_planes.write_atomic(cached, _arrays(jobs, records, progress),
                                 lambda: {"repack_version": str(gguf_planes.REPACK_VERSION),
                                          "weights": json.dumps(records)})
    finally:
        joined.unlink(missing_ok=True)


def _arrays(jobs: list, records: dict[str, list[object]], progress: bool) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every plane of every tensor, one tensor in memory at a time; each
    quantized weight's [type, out, in] goes into ``records``."""
    from tqdm import tqdm

    for job in tqdm(jobs, desc="repacking GGUF", unit="tensor", file=sys.stderr, disable=not progress):
        type_name = job.tensor.tensor_type.name
        if len(job.shape) == 1 or type_name in gguf_planes.FLOAT_TYPES:
            yield f"{job.hf_name}", gguf_convert.dequantize_tensor(job.tensor, job.shape, job.unpermute_heads)
            continue
        out, inp = job.shape
        planes = gguf_planes.repack(np.asarray(job.tensor.data), type_name, out, inp)
        if job.unpermute_heads is not None:  # rows are quantized independently: permuting them is exact
            planes = {k: gguf_convert.unpermute_qk(v, job.unpermute_heads) for k, v in planes.items()}
        records[job.hf_name] = [type_name, out, inp]
        for plane, array in planes.items():
            yield f"{job.hf_name}.{plane}", np.ascontiguousarray(array)


def _read(cached: Path) -> NativeWeights:
    out: NativeWeights = {}
    planes: dict[str, dict[str, Tensor]] = {}
    with safe_open(cached, framework="pt") as f:
        records = json.loads(f.metadata()["weights"])
        for name in f.keys():
            hf, _, plane = name.rpartition(".")
            if name.startswith("__pad"):
                continue
            if hf in records:
                planes.setdefault(hf, {})[plane] = f.get_tensor(name)
            else:
                out[name] = f.get_tensor(name)
    for hf, (type_name, o, i) in records.items():
        out[hf] = gguf_planes.weight_from_planes(type_name, o, i, planes[hf])
    return out


def decoder_weights(weights: NativeWeights, config: ModelConfig) -> dict[str, object]:
    """The decoder's packed dict (see ``packed.pack``) with ``GGUFLinear`` matrices."""

    def native(name: str) -> GGUFWeight:
        w = weights[name]
        if not isinstance(w, GGUFWeight):
            raise UnsupportedModelError(f"{name} is a float tensor; native mode runs quantized matrices only "
                                        "(use --quantize none)")
        return w

    config.check_layers(weights, "the GGUF file")
    out: dict[str, object] = {"embed": native("model.embed_tokens.weight"), "norm": weights["model.norm.weight"]}
    if not config.tie_word_embeddings:
        out["lm_head"] = GGUFLinear((native("lm_head.weight"),))
    else:
        out["lm_head"] = GGUFLinear((out["embed"],))
    for i in range(config.num_layers):
        p, a, m, q = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"layers.{i}."
        out[q + "in_norm"] = weights[p + "input_layernorm.weight"]
        out[q + "post_norm"] = weights[p + "post_attention_layernorm.weight"]
        out[q + "qkv"] = GGUFLinear(tuple(native(f"{a}{n}_proj.weight") for n in "qkv"))
        if f"{a}q_proj.bias" in weights:
            out[q + "qkv_bias"] = torch.cat([weights[f"{a}{n}_proj.bias"] for n in "qkv"])
        out[q + "o"] = GGUFLinear((native(a + "o_proj.weight"),))
        out[q + "gate_up"] = GGUFLinear((native(m + "gate_proj.weight"), native(m + "up_proj.weight")))
        out[q + "down"] = GGUFLinear((native(m + "down_proj.weight"),))
    return out
