"""Writing heads so that a crash never leaves half of one where a whole one was.

``write_files`` writes each file atomically (``files.atomic_path``), weights before the config
that describes them. A head folder is also the training run's folder (its checkpoint and
captured data live inside), so files are replaced one by one, never the folder; a folder written
whole (a checkpoint, an export) goes through ``files.write_folder``.

``read_config`` and ``read_weights`` read a head folder back, with a ``CheckpointError`` that
names what is missing or damaged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specdecode.errors import CheckpointError
from specdecode.files import atomic_path


def write_files(folder: Path, writers: dict[str, Callable[[Path], None]]) -> Path:
    """Write each ``name`` of ``folder`` with ``writers[name](tmp_path)``, in order, each renamed
    into place once complete."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, write in writers.items():
        with atomic_path(folder / name) as tmp:
            write(tmp)
            os.chmod(tmp, 0o666 & ~_umask())  # some writers create private files; a head is shared
    return folder


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_head(folder: Path, weights: dict[str, torch.Tensor], config: dict[str, Any],
               readme: str | None = None) -> Path:
    """A head folder's ``model.safetensors``, then its ``config.json``, then its model card."""
    writers = {"model.safetensors": lambda path: save_file(weights, str(path), metadata={"format": "pt"}),
               "config.json": lambda path: path.write_text(json.dumps(config, indent=2) + "\n")}
    if readme is not None:
        writers["README.md"] = lambda path: path.write_text(readme)
    return write_files(folder, writers)


def read_config(folder: Path) -> dict[str, Any]:
    """A head folder's config.json, or ``CheckpointError`` saying what is missing."""
    path = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"no head folder at {folder}")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no config.json; is it a head folder?") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a head folder's safetensors files, or ``CheckpointError``."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            weights.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {path} (damaged or incomplete?): {exc}") from None
    return weights
