"""Writing heads and checkpoints so that a crash never leaves half of one where a whole one was.

- ``write_files``: each file is written beside its destination under a hidden partial name and
  renamed into place, weights before the config that describes them. A head folder is also the
  training run's folder (its checkpoint and captured data live inside), so files are replaced
  one by one, never the folder.
- ``write_folder``: a folder (a checkpoint) is written whole under a partial name, then swapped
  in: the old folder is renamed aside, the new one renamed into place, the old one deleted. A
  reader finds the old folder or the new one; after a crash between the two renames ``recover``
  puts the old one back.

``read_config`` and ``read_weights`` read a head folder back, with a ``CheckpointError`` that
names what is missing or damaged.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specdecode.errors import CheckpointError
from specdecode.files import partial_path


def write_files(folder: Path, writers: dict[str, Callable[[Path], None]]) -> Path:
    """Write each ``name`` of ``folder`` with ``writers[name](tmp_path)``, in order, each renamed
    into place once complete."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, write in writers.items():
        dest = folder / name
        tmp = partial_path(dest)
        try:
            write(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_umask())  # some writers create private files; a head is shared
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
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


def write_folder(dest: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` into a fresh folder, then swap it in as ``dest``."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    recover(dest)
    tmp = partial_path(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        _sync_folder(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = partial_path(dest, "old")
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def recover(dest: Path) -> None:
    """If a swap into ``dest`` was cut between its renames, restore the folder renamed aside."""
    dest = Path(dest)
    if dest.exists():
        return
    for old in sorted(dest.parent.glob(f".{dest.name}.*.old")):
        os.replace(old, dest)
        return


def _sync_folder(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


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
