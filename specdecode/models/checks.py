"""Sizes and SHA-256 checksums of the files conversion and packing write, checked on load.

A cache file can be damaged without failing to parse: bytes zeroed by a disk error or a crash
before the data reached the disk leave a file of the right shape that runs and gives different
text. So every derived file is recorded when written (size and SHA-256, in a sidecar
``NAME.check.json`` beside it, or in the conversion marker for the small files of a converted
folder) and checked on load: the size always (a ``stat``, free), the full hash when asked
(``specdecode models verify NAME``) and after a crash (a dead writer's leftovers in the cache's
folder: the machine may have gone down before recent writes reached the disk). Hashing reads
every byte (docs/SERVING.md has the rate): seconds for a cache of gigabytes, too slow for every
load.

A sidecar is written before its file is renamed into place, so a file that is present always has
its record; a file without one was written by an older version and is accepted unchecked.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from specdecode.files import atomic_path

_CHUNK = 16 << 20


class State(str, Enum):
    OK = "ok"
    DAMAGED = "damaged"
    UNRECORDED = "unrecorded"  # written before checksums were recorded: cannot tell
    MISSING = "missing"


@dataclass(frozen=True)
class Record:
    size: int
    sha256: str

    def to_json(self) -> dict[str, object]:
        return {"size": self.size, "sha256": self.sha256}

    @staticmethod
    def from_json(data: object) -> Record | None:
        try:
            return Record(int(data["size"]), str(data["sha256"]))  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            return None


class HashingWriter:
    """A binary file handle that hashes what is written through it (no second read)."""

    def __init__(self, handle) -> None:  # noqa: ANN001 - any binary file object
        self.handle, self.digest, self.size = handle, hashlib.sha256(), 0

    def write(self, data) -> int:  # noqa: ANN001 - bytes-like
        self.digest.update(data)
        self.size += memoryview(data).nbytes
        return self.handle.write(data)

    def record(self) -> Record:
        return Record(self.size, self.digest.hexdigest())


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".check.json")


def hash_file(path: Path, progress: bool = False) -> Record:
    """Size and SHA-256 of ``path``, read in chunks (with a progress bar when asked)."""
    from tqdm import tqdm

    digest, size = hashlib.sha256(), path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, desc=f"checking {path.name}", unit="B", unit_scale=True,
                                     file=sys.stderr, disable=not progress) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return Record(size, digest.hexdigest())


def write_sidecar(target: Path, record: Record) -> None:
    """Record ``target``'s size and hash; call it before renaming the file to ``target``."""
    with atomic_path(sidecar(target), sync=False) as tmp:
        tmp.write_text(json.dumps(record.to_json()) + "\n")


def read_sidecar(path: Path) -> Record | None:
    try:
        return Record.from_json(json.loads(sidecar(path).read_text()))
    except (OSError, ValueError):
        return None


def state(path: Path, record: Record | None, full: bool, progress: bool = False) -> State:
    """``path`` against ``record``: its size only, or its hash too when ``full``."""
    if not path.is_file():
        return State.MISSING
    if record is None:
        return State.UNRECORDED
    if path.stat().st_size != record.size:
        return State.DAMAGED
    if full and hash_file(path, progress).sha256 != record.sha256:
        return State.DAMAGED
    return State.OK


def intact(path: Path, full: bool = False, progress: bool = False) -> bool:
    """Whether a present cache file may be used: its sidecar's size (and hash, when ``full``)
    match, or it has no sidecar (an older version wrote it)."""
    return state(path, read_sidecar(path), full, progress) is not State.DAMAGED


def remove_with_sidecar(path: Path) -> None:
    path.unlink(missing_ok=True)
    sidecar(path).unlink(missing_ok=True)
