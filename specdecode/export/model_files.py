"""A model folder as other engines load it: HF config, safetensors weights, tokenizer files.

Catalog models are converted from GGUF and keep their float weights in ``model.safetensors``
(made on demand by ``write_float_weights``), next to our own conversion record. An engine such as
vLLM reads GGUF only partly, so the export hands it the float safetensors with the HF files
beside them, and leaves our records out.

Weights already in the wanted dtype are hard-linked when the export lies on the same file
system (a 7 GB target costs no disk and no time), else copied; weights in another dtype are cast
and streamed tensor by tensor (one tensor in memory at a time). A hard link shares its bytes with
the source, so both names are made read-only: rewriting the export's weights in place would
rewrite the cache's. A progress bar counts the bytes.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from specdecode.errors import UnsupportedModelError
from specdecode.export.choices import EXPORT_DTYPES
from specdecode.models.gguf_convert import MARKER_NAME, write_float_weights

HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
            "model.safetensors.index.json")
# Our dtype names and safetensors' codes for them, one table read both ways.
_CODES = dict(zip(EXPORT_DTYPES, ("F32", "BF16", "F16")))
_NAMES = {code: name for name, code in _CODES.items()}
_CHUNK = 64 << 20


def source_folder(model_dir: Path, progress: bool = True) -> Path:
    """``model_dir`` with its float safetensors present (dequantized from its GGUF if need be)."""
    model_dir = Path(model_dir)
    if (model_dir / MARKER_NAME).is_file():
        write_float_weights(model_dir, progress=progress)
    if not weight_files(model_dir):
        raise UnsupportedModelError(f"{model_dir} has no .safetensors weights to export; vLLM loads safetensors "
                                    "(convert .bin checkpoints first)")
    return model_dir


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in Path(model_dir).glob("*.safetensors") if not p.name.startswith("."))


def stored_dtype(model_dir: Path) -> str:
    """The dtype of the first floating-point tensor in the folder's weights."""
    with safe_open(str(weight_files(model_dir)[0]), framework="pt") as f:
        for name in f.keys():
            tensor = f.get_slice(name)
            dtype = tensor.get_dtype()
            if dtype in _NAMES:
                return _NAMES[dtype]
    return "float32"


def write_model_folder(src: Path, dest: Path, dtype: str | None, progress: bool = True) -> Path:
    """Write ``src``'s HF files and weights into the new folder ``dest``, weights in ``dtype``
    (None: as stored)."""
    from tqdm import tqdm

    src, dest = Path(src), Path(dest)
    dest.mkdir(parents=True, exist_ok=False)
    for name in HF_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)
    dtype = dtype or stored_dtype(src)
    _set_config_dtype(dest / "config.json", dtype)
    files = weight_files(src)
    same = stored_dtype(src) == dtype
    total = sum(p.stat().st_size for p in files)
    with tqdm(total=total, desc=f"export {src.name}", unit="B", unit_scale=True, disable=not progress,
              dynamic_ncols=True, mininterval=0.5) as bar:
        for path in files:
            if same:
                _link_or_copy(path, dest / path.name, bar)
            else:
                _cast(path, dest / path.name, dtype)
                bar.update(path.stat().st_size)
    return dest


def _set_config_dtype(config_path: Path, dtype: str) -> None:
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = dtype
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def _link_or_copy(src: Path, dest: Path, bar: object) -> None:
    try:
        os.link(src, dest)
        os.chmod(dest, dest.stat().st_mode & ~0o222)  # one inode: read-only under both names
        bar.update(src.stat().st_size)  # type: ignore[attr-defined]
        return
    except OSError:
        pass  # another file system, or links not allowed: copy
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        for chunk in _chunks(fin):
            fout.write(chunk)
            bar.update(len(chunk))  # type: ignore[attr-defined]


def _chunks(handle) -> Iterable[bytes]:  # type: ignore[no-untyped-def]
    while chunk := handle.read(_CHUNK):
        yield chunk


def _cast(src: Path, dest: Path, dtype: str) -> None:
    """Stream ``src``'s tensors into ``dest`` as safetensors, floats cast to ``dtype``: the header
    first (shapes are known), then one tensor at a time."""
    with safe_open(str(src), framework="pt") as f:
        names = list(f.keys())
        header: dict[str, object] = {"__metadata__": f.metadata() or {"format": "pt"}}
        offset = 0
        for name in names:
            view = f.get_slice(name)
            code = _CODES[dtype] if view.get_dtype() in _NAMES else view.get_dtype()  # floats are cast
            size = _nbytes(view.get_shape(), code)
            header[name] = {"dtype": code, "shape": list(view.get_shape()), "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(dest, "wb") as out:
            out.write(len(blob).to_bytes(8, "little"))
            out.write(blob)
            for name in names:
                tensor = f.get_tensor(name)
                if tensor.is_floating_point():
                    tensor = tensor.to(getattr(torch, dtype))
                out.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    if dest.stat().st_size != 8 + len(blob) + offset:
        raise OSError(f"short write of {dest}")


_ITEM_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _nbytes(shape: list[int], code: str) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * _ITEM_BYTES[code]
