"""GGUF weights run as shipped: quantized tensors repacked losslessly into the planes the GGUF
kernel reads (``csrc/linear_gguf.cpp``), cached on disk and memory-mapped.

Why a repack and not the raw blocks: a GGUF block interleaves fp16 scales, packed 6-bit scales
and the quantized values at odd byte offsets (Q4_K: 144 bytes). Splitting them into planes makes
every load of values 32-byte aligned, turns fp16 scales into float32 and 6-bit scales into bytes
once, not on every call. Nothing is rounded: each plane holds the same integers the block held,
and an fp16 scale is exactly a float32. ``GGUFWeight.dequantize`` is the reference the tests
hold against ``gguf.quants``.

Norms and biases (F32 in every file we know) stay float tensors. The cache lives under
``$SPECDECODE_HOME/native/``, keyed by the source files' paths, sizes and mtimes, and is written
atomically, so an interrupted repack leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from specdecode.errors import UnsupportedModelError
from specdecode.files import atomic_path, partial_path
from specdecode.models import checks, kernel_build

REPACK_VERSION = 3
INT4_PACK_VERSION = 1  # of a draft's int4 pack (``draft_quant.pack_int4``): bump when its output changes
# GGML type id -> (name, inputs per block, bytes per block). The kernel's type codes are these ids.
TYPES = {
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}
NATIVE_TYPES = tuple(name for name, _, _ in TYPES.values())
FLOAT_TYPES = ("F32", "F16", "BF16")
PLANES = ("q", "qh", "sc", "mn", "d", "dm")
_EMPTY = torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True, slots=True)
class GGUFWeight:
    """One weight matrix [out, in] in a GGUF block format, as the kernel's six planes."""

    type_id: int
    out: int
    inp: int
    planes: tuple[Tensor, ...]  # q, qh, sc, mn, d, dm; an absent plane is an empty tensor
    part: tuple[Any, ...] = field(init=False, repr=False, compare=False)  # the kernel's argument

    def __post_init__(self) -> None:
        object.__setattr__(self, "part", (self.type_id, self.out, list(self.planes)))

    @property
    def type_name(self) -> str:
        return TYPES[self.type_id][0]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out, self.inp))

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes)

    def rows(self, ids: Tensor) -> Tensor:
        """Float32 rows ``ids`` [N] -> [N, in]: an embedding lookup."""
        return kernel_build.load_gguf().dequantize_rows(self.type_id, self.out, self.inp, self.part[2],
                                                        ids.reshape(-1).long())

    def dequantize(self) -> Tensor:
        return self.rows(torch.arange(self.out))


@dataclass(frozen=True, slots=True)
class GGUFLinear:
    """Matrices applied to the same input in one kernel call, outputs concatenated: q|k|v and
    gate|up, whose parts may differ in type (a Q4_K_M file has Q4_K q/k and a Q6_K v)."""

    parts: tuple[GGUFWeight, ...]
    args: list[Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", [p.part for p in self.parts])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.out for p in self.parts), self.parts[0].inp))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


def repack(raw: np.ndarray, type_name: str, out: int, inp: int) -> dict[str, np.ndarray]:
    """GGUF bytes of one tensor ([out, row bytes] uint8) -> the kernel's planes (lossless)."""
    type_id = next((i for i, (n, _, _) in TYPES.items() if n == type_name), None)
    if type_id is None:
        raise UnsupportedModelError(f"no native kernel for {type_name}")
    _, block, size = TYPES[type_id]
    if inp % block or raw.size != out * (inp // block) * size:
        raise UnsupportedModelError(f"{type_name} tensor [{out}, {inp}] has {raw.size} bytes, not whole blocks")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(out, inp // block, size)
    f16 = lambda cols: b[..., cols].copy().view(np.float16).astype(np.float32)[..., 0]  # noqa: E731
    planes: dict[str, np.ndarray] = {}
    if type_name in ("Q4_K", "Q5_K"):
        from gguf.quants import Q4_K  # imported by the repack only: some 50 ms

        planes["d"], planes["dm"] = f16(slice(0, 2)), f16(slice(2, 4))
        sc, mn = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        planes["sc"] = sc.reshape(out, -1)
        planes["mn"] = mn.reshape(out, -1)  # one per 32 inputs
        if type_name == "Q5_K":
            planes["qh"], planes["q"] = b[..., 16:48].reshape(out, -1), b[..., 48:176].reshape(out, -1)
        else:
            planes["q"] = b[..., 16:144].reshape(out, -1)
    elif type_name == "Q6_K":
        planes["q"], planes["qh"] = b[..., 0:128].reshape(out, -1), b[..., 128:192].reshape(out, -1)
        planes["sc"], planes["d"] = b[..., 192:208].reshape(out, -1), f16(slice(208, 210))
    else:
        planes["d"] = f16(slice(0, 2))
        start = 2
        if type_name in ("Q4_1", "Q5_1"):
            planes["dm"], start = f16(slice(2, 4)), 4
        if type_name in ("Q5_0", "Q5_1"):
            planes["qh"], start = b[..., start : start + 4].reshape(out, -1), start + 4
        planes["q"] = b[..., start:].reshape(out, -1)
    return {k: np.ascontiguousarray(v) for k, v in planes.items()}


def weight_from_planes(type_name: str, out: int, inp: int, planes: dict[str, Tensor]) -> GGUFWeight:
    type_id = next(i for i, (n, _, _) in TYPES.items() if n == type_name)
    return GGUFWeight(type_id, out, inp, tuple(planes.get(p, _EMPTY) for p in PLANES))


def check_type(tensor_name: str, type_name: str, inp: int) -> None:
    """Refuse, by name, a weight the native kernel cannot run."""
    if type_name not in NATIVE_TYPES:
        raise UnsupportedModelError(
            f"tensor {tensor_name} is {type_name}, which has no native kernel (supported: "
            f"{', '.join(NATIVE_TYPES)}); run it dequantized with --quantize none")
    block = next(b for n, b, _ in TYPES.values() if n == type_name)
    if inp % block:
        raise UnsupportedModelError(f"tensor {tensor_name} has {inp} inputs, not whole {type_name} blocks of {block}; "
                                    "run it dequantized with --quantize none")


def cache_path(sources: Sequence[Path], home: Path, version: int = REPACK_VERSION) -> Path:
    """Where the planes of ``sources`` repacked by ``version`` are cached."""
    key = json.dumps([version] + [[str(Path(s).resolve()), Path(s).stat().st_size, Path(s).stat().st_mtime_ns]
                                         for s in sources])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return home / "native" / f"{Path(sources[0]).stem}-{digest}.safetensors"


def int4_cache_path(sources: Sequence[Path], home: Path) -> Path:
    """Where the int4 draft pack of the GGUF in ``sources`` is cached (``gguf_load.int4_draft_weights``):
    beside its planes."""
    planes = cache_path(sources, home)
    return planes.with_name(f"{planes.stem}.int4-v{INT4_PACK_VERSION}.safetensors")


def write_atomic(target: Path, arrays: Iterator[tuple[str, np.ndarray]], metadata: Callable[[], dict[str, str]]) -> None:
    """Stream named arrays into a safetensors file, one array in memory at a time, renamed into
    place when whole, its size and hash recorded beside it (``checks``). The data goes to a side
    file first (the header, which comes first in the file, is known only at the end);
    ``metadata`` is asked for once every array has been seen."""
    data = partial_path(target, "data")
    try:
        with atomic_path(target) as tmp:
            header: dict[str, Any] = {}
            with open(data, "wb") as f:
                for name, arr in arrays:
                    pad = -f.tell() % 32  # 32-byte aligned planes for aligned vector loads
                    if pad:  # safetensors wants the data covered: padding is a tensor of its own
                        header[f"__pad{f.tell()}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [f.tell(), f.tell() + pad]}
                        f.write(b"\0" * pad)
                    start = f.tell()
                    f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
                    header[name] = {"dtype": _ST_DTYPES[arr.dtype], "shape": list(arr.shape), "data_offsets": [start, f.tell()]}
                size = f.tell()
            header["__metadata__"] = metadata()
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-(8 + len(blob)) % 32)
            with open(tmp, "wb") as out, open(data, "rb") as src:
                hashing = checks.HashingWriter(out)
                hashing.write(len(blob).to_bytes(8, "little"))
                hashing.write(blob)
                shutil.copyfileobj(src, hashing, 16 << 20)
            if tmp.stat().st_size != 8 + len(blob) + size:
                raise OSError(f"short write of {tmp}")
            checks.write_sidecar(target, hashing.record())
    finally:
        data.unlink(missing_ok=True)


_ST_DTYPES = {np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32", np.dtype(np.int8): "I8"}
