"""File helpers shared by the caches: a cross-process lock around work done once per machine."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: Path, what: str, progress: bool = True) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created if absent) while the block runs.

    Serializes one-time work across processes (a server and a CLI run converting the same model,
    two bench runs building the same peer); when another holder has it, says what we wait for.
    Without ``flock`` (Windows) the block runs unlocked: the work is still written atomically,
    only possibly done twice.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"waiting for another process doing {what} ...", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
