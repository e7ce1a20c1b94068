"""File helpers shared by the caches: a cross-process lock around work done once per machine, and
the naming and cleanup of partial writes."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def specdecode_home() -> Path:
    """Where every cache lives: ``$SPECDECODE_HOME`` or ``~/.cache/specdecode``, read at call time so
    tests can redirect it."""
    return Path(os.environ.get("SPECDECODE_HOME") or "~/.cache/specdecode").expanduser()


@contextmanager
def file_lock(path: Path, what: str, progress: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (created if absent) while the block runs; yields whether
    it really holds one.

    Serializes one-time work across processes (a server and a CLI run converting the same model,
    two bench runs building the same peer); when another holder has it, says what we wait for.
    Without ``flock`` (Windows) the block runs unlocked and gets False: the work is still written
    atomically, only possibly done twice.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"waiting for another process doing {what} ...", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# Leftovers of a writer killed mid-write (kill -9, power loss) carry its PID in their name:
# ``.NAME.PID.KIND`` (a file or folder beside the target). A later run deletes those whose PID is
# no longer alive; a live writer's are never touched.
_PARTIAL = re.compile(r"^\..+\.(?P<pid>\d+)\.(?:partial|data|joined\.gguf|building|old)$")


def partial_path(target: Path, kind: str = "partial") -> Path:
    """Where to write ``target`` before renaming it into place: beside it, hidden, with our PID."""
    return target.with_name(f".{target.name}.{os.getpid()}.{kind}")


def remove_stale_partials(folder: Path) -> list[Path]:
    """Delete the leftovers of dead writers in ``folder``; returns what was removed."""
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _PARTIAL.match(entry.name)
        if match is None or _alive(int(match["pid"])):
            continue
        try:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            removed.append(entry)
        except OSError:
            pass  # another process cleaned it first, or it is not ours to remove
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's live process (or not a PID): leave it alone
    return True
