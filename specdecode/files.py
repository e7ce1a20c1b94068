"""File helpers shared by the caches, heads, exports and checkpoints: where specdecode keeps its
files, a cross-process lock around work done once per machine, the one way a file or a folder is
written atomically, and the naming and cleanup of partial writes.

Files and folders are written atomically through ``atomic_path`` (a file) or ``write_folder`` (a
folder), so the guarantee is the same everywhere: a reader sees the previous version or the
complete new one, never half of one, and a failed write leaves nothing behind but, after a kill,
a PID-named leftover that ``remove_stale_partials`` deletes. (A datastore, ``index/build.py``,
swaps its folder in by hand: it checks again, between the renames, that it may replace one.)"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


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
                log.info(f"waiting for another process doing {what} ...")
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


@contextmanager
def atomic_path(target: Path, sync: bool = True, kind: str = "partial") -> Iterator[Path]:
    """Yield a hidden path beside ``target`` (``partial_path``) for the block to write; when the
    block returns, the file is flushed to disk (``sync``) and renamed over ``target`` in one step.

    When the block raises, the partial file is removed and ``target`` keeps its previous content.
    The partial file sits in ``target``'s folder so the rename never crosses file systems.
    ``sync=False`` is for derived caches that are checked against their record or rebuilt on the
    next run, where an fsync of gigabytes would cost more than a rebuild after a power loss. A
    record written beside the file inside the block (``checks.write_sidecar``) lands before it.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(target, kind)
    try:
        yield tmp
        if sync:
            _fsync(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_folder(dest: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` into a fresh folder beside ``dest``, flush its files to disk, then swap it
    in as ``dest``: ``dest`` holds the previous folder or the complete new one, never a mix."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    recover(dest)
    tmp = partial_path(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                _fsync(path)
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


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


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


def read_user_text(path: Path, what: str, max_bytes: int) -> str:
    """The UTF-8 text of a file a user named (``what``: the option, e.g. "--prompt-file"), or an
    ``InvalidConfigError`` saying what is wrong with it. At most ``max_bytes`` are read, so
    ``/dev/zero`` or a huge file is refused instead of filling the memory; NUL bytes mark a binary
    file, which no prompt or question list is."""
    from specdecode.errors import InvalidConfigError

    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise InvalidConfigError(f"{what} {path}: no such file") from None
    except OSError as exc:
        raise InvalidConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(data) > max_bytes:
        raise InvalidConfigError(f"{what} {path} is larger than {max_bytes >> 20} MiB, more than it can usefully hold")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidConfigError(f"{what} {path} is not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x})") from None
    if "\x00" in text:
        raise InvalidConfigError(f"{what} {path} holds NUL bytes: it looks like a binary file, not text")
    return text
