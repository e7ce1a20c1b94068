"""Kept prefixes on disk: a prefix cache's idle entries saved to one safetensors file and restored
into a later process, so a long system prompt or document is prefilled once, not once a run
(llama.cpp's slot save/restore does this for one slot).

The file holds one *part* per pool (``target``, and ``draft`` for a draft model's companion pool):
for each idle entry, least recently used first, its token ids (``PART.I.ids``, int64 [L]) and the
keys and values of its ``L`` held slots only (``PART.I.k`` / ``PART.I.v``, [layers, kv_heads, L,
head_dim]), not the cache's whole capacity. The metadata holds the format name and version, each
part's identity and entry count, and a SHA-256 over the parts' record and every tensor byte.

Why an identity: a restored prefix is only worth its bits if they are the bits a prefill here
would compute (the engine promises bitwise the output of an uncached run). So each part records
what those bits depend on (``model_identity``): the weights, the dtype and quantization, the
backend, and the numerics code; the pool adds its KV layout. A part restores only into a pool whose
identity is equal; a part that differs is skipped with a warning, and a file none of whose parts
matches raises ``PrefixCacheFileError``, as does a damaged or truncated file (checked whole before
anything is restored). Entries go in under the pool's budget like any kept cache: least recently
used ones are evicted to make room, and an entry that still does not fit is skipped.

Writing streams one tensor at a time (a pool of gigabytes is not copied whole) into a partial file
beside the target, flushed to disk and renamed over it (``files.atomic_path``): a crash leaves the
previous file or the complete new one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch
from torch import Tensor

from specdecode.errors import PrefixCacheFileError
from specdecode.files import atomic_path
from specdecode.models import kernel_build

if TYPE_CHECKING:
    from specdecode.models.decoder import Decoder
    from specdecode.models.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

FORMAT = "specdecode-prefix-cache"
VERSION = 1
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}
_PLACEHOLDER = "0" * 64  # the digest's place in the header until the data is written
_CHUNK = 16 << 20
_MAX_HEADER = 64 << 20


@dataclass(frozen=True, slots=True)
class Pool:
    """One part of a file: a prefix cache and the identity its entries must be restored under."""

    cache: PrefixCache
    identity: dict[str, Any]


def model_identity(decoder: Decoder, model_dir: Path, quantize: str | None) -> dict[str, Any]:
    """What a model's keys and values depend on, cheap to compute at every save and load.

    Weights: the config's fingerprint and, for each file the weights are read from (the GGUF
    sources a converted folder lists, else its ``*.safetensors``), its name, size and modification
    time in nanoseconds. Hashing gigabytes at every start would cost seconds, and no hash is at
    hand for every file (pip records the catalog parts', nothing records a user's folder); size and
    mtime are what the packed and native weight caches are keyed by already, so a file they would
    reuse is one this accepts. Names, not paths: a folder moved with its files keeps its prefixes.
    Numerics: dtype, quantization, the backend class and its attention, and ``numerics_identity``."""
    from specdecode.errors import UnsupportedModelError
    from specdecode.models.config import config_fingerprint
    from specdecode.models.gguf_convert import gguf_sources

    model_dir = Path(model_dir)
    try:
        files = gguf_sources(model_dir)
    except UnsupportedModelError:  # not converted from a GGUF, or its GGUF is gone: the folder's weights
        files = sorted(model_dir.glob("*.safetensors"))
    weights = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    return {"config": config_fingerprint(model_dir), "weights": weights, "dtype": str(decoder.dtype),
            "quantize": quantize or "none", "backend": type(decoder.backend).__name__,
            "attention": decoder.backend.attend.__name__, **numerics_identity()}


@functools.cache
def numerics_identity() -> dict[str, Any]:
    """The code behind the bits: the package and torch versions, a SHA-256 of the C++ kernel
    sources, and the build flags this CPU selects (the linear kernel's lane count changes its bits)."""
    from specdecode import __version__

    digest = hashlib.sha256()
    for source in sorted((Path(__file__).parent / "csrc").iterdir()):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return {"specdecode": __version__, "torch": torch.__version__, "kernels": digest.hexdigest(),
            "build": " ".join(kernel_build.compile_flags()), "native": os.environ.get("SPECDECODE_NATIVE", "1")}


def save(path: Path, pools: Mapping[str, Pool]) -> dict[str, int]:
    """Write every pool's idle entries to ``path`` atomically; tokens written per part. The pools
    stay locked while they are written (``PrefixCache.frozen``)."""
    with contextlib.ExitStack() as stack:
        snapshots = {name: stack.enter_context(pool.cache.frozen()) for name, pool in pools.items()}
        parts = {name: {"identity": pool.identity | pool.cache.layout(), "entries": len(snapshots[name])}
                 for name, pool in pools.items()}
        tensors = [(f"{name}.{i}.{kind}", tensor) for name, entries in snapshots.items()
                   for i, entry in enumerate(entries) for kind, tensor in zip(("ids", "k", "v"), entry)]
        try:
            with atomic_path(Path(path)) as tmp, open(tmp, "wb") as f:
                _write(f, json.dumps(parts, sort_keys=True), tensors)
        except OSError as exc:
            raise PrefixCacheFileError(f"cannot write the prefix cache file {path}: {exc.strerror or exc}") from None
        return {name: sum(ids.shape[0] for ids, _, _ in entries) for name, entries in snapshots.items()}


def _write(f: BinaryIO, parts: str, tensors: list[tuple[str, Tensor]]) -> None:
    """A safetensors file: the header (offsets known from the shapes, the digest a placeholder of
    its final length), the tensors' bytes, then the header again with the digest."""
    header: dict[str, Any] = {}
    offset = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size

    def blob(digest: str) -> bytes:
        meta = {"format": FORMAT, "version": str(VERSION), "parts": parts, "sha256": digest}
        text = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
        return text + b" " * (-len(text) % 8)

    head = blob(_PLACEHOLDER)
    f.write(len(head).to_bytes(8, "little") + head)
    digest = hashlib.sha256(parts.encode())
    for _, tensor in tensors:
        data = tensor.contiguous().view(torch.uint8).numpy()  # one tensor's copy at a time
        digest.update(data)
        f.write(data)
    f.seek(8)
    f.write(blob(digest.hexdigest()))


def load(path: Path, pools: Mapping[str, Pool]) -> dict[str, int]:
    """Restore the parts of ``path`` whose identity matches their pool's; tokens restored per part
    (see the module docstring for what is skipped and what raises)."""
    path = Path(path)
    meta = _verified_metadata(path)
    parts = json.loads(meta["parts"])
    matched, reasons = {}, []
    for name, pool in pools.items():
        part = parts.get(name)
        want = json.loads(json.dumps(pool.identity | pool.cache.layout()))  # as the file holds it: lists, not tuples
        if part is None:
            reasons.append(f"it holds no {name} part")
        elif part["identity"] != want:
            reasons.append(f"its {name} part was made with another {_differences(part['identity'], want)}")
        else:
            matched[name] = int(part["entries"])
    if not matched:
        raise PrefixCacheFileError(f"{path} does not fit this model: {'; '.join(reasons)}")
    for reason in reasons:
        log.warning(f"specdecode: {path}: {reason}; restoring the rest")
    return {name: pools[name].cache.adopt(_entries(path, name, count)) for name, count in matched.items()}


def _differences(have: dict[str, Any], want: dict[str, Any]) -> str:
    keys = sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k))
    return ", ".join(keys) + " (the file is for another model, dtype or build: delete it or let it be rewritten)"


def _verified_metadata(path: Path) -> dict[str, str]:
    """The metadata of ``path`` once its format, length and digest check out."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or not 0 < n <= min(size - 8, _MAX_HEADER):
                raise PrefixCacheFileError(f"{path} is truncated or not a prefix cache file")
            try:
                header = json.loads(f.read(n))
                meta = header.pop("__metadata__")
                end = max((t["data_offsets"][1] for t in header.values()), default=0)
            except (ValueError, KeyError, TypeError, AttributeError):
                raise PrefixCacheFileError(f"{path} is damaged or not a prefix cache file (its header does not parse)") from None
            if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
                raise PrefixCacheFileError(f"{path} is not a {FORMAT} file of version {VERSION} "
                                           f"(it says {meta.get('format')!r} {meta.get('version')!r})")
            if size - 8 - n != end:
                raise PrefixCacheFileError(f"{path} is truncated: {size - 8 - n} data bytes, its header lists {end}")
            digest = hashlib.sha256(str(meta.get("parts", "")).encode())
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except OSError as exc:
        raise PrefixCacheFileError(f"cannot read the prefix cache file {path}: {exc.strerror or exc}") from None
    if digest.hexdigest() != meta.get("sha256"):
        raise PrefixCacheFileError(f"{path} is damaged: its checksum does not match its contents")
    return meta


def _entries(path: Path, part: str, count: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """The entries of ``part``, least recently used first, each read when asked for."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for i in range(count):
                yield tuple(f.get_tensor(f"{part}.{i}.{kind}") for kind in ("ids", "k", "v"))  # type: ignore[misc]
    except (SafetensorError, OSError) as exc:
        raise PrefixCacheFileError(f"cannot read the prefix cache file {path}: {exc}") from None
