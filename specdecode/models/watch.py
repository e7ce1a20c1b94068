"""The derived files a process maps, hashed in the background and repaired in place.

A load checks a derived cache's size only (a ``stat``): hashing gigabytes would delay the first
token by seconds. But bytes damaged at the same size (a disk error, a stray write) run and give
wrong text. So every mapped derived file is registered here, and a daemon thread at a low CPU
priority (``NICE``) hashes each against its record soon after load and again every
``RECHECK_S``: on a busy 2-core machine it gets about a tenth of a core, so the first token is
barely slowed and damage is found within about ten seconds of load.

On a mismatch the process refuses to decode (``check`` raises ``DamagedCacheError``, a 503 in
the server) while the file is rebuilt from its source beside it and copied into the mapped file
in place: the tensors are file-backed shared mappings, so the running process sees the repaired
bytes without reloading, and serving resumes once the file hashes to its record again. A
rebuild that does not fit the old layout (the source changed) replaces the file for the next
start and leaves this process refusing, with a message that says to restart it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdecode.engine.openmp import release_pool
from specdecode.errors import DamagedCacheError
from specdecode.files import partial_path
from specdecode.models import checks

log = logging.getLogger(__name__)

RECHECK_S = 3600.0  # a long-running server re-hashes its files this often
# The hashing thread's nice value: CFS then gives it about a tenth of a core the model's threads
# want (nice 19 would get 1.5%: over a minute for 1.3 GB on a busy server, where the issue asks
# for seconds), about 1.5 GB/s of SHA-256 when the cores are idle.
NICE = 10
_CHUNK = 16 << 20


@dataclass
class Watched:
    path: Path
    rebuild: Callable[[Path], None]  # writes the file afresh to the path given (with its sidecar)
    inode: int  # the file as mapped: a load that rebuilt it maps a new one
    checked_at: float | None = None  # monotonic time of the last full hash
    busy: bool = False  # being hashed or repaired


class CacheWatch:
    """Registered mapped files, their background hashing and repair (see the module doc)."""

    def __init__(self, recheck_s: float = RECHECK_S, background: bool = True) -> None:
        self.recheck_s, self.background = recheck_s, background
        self._files: dict[Path, Watched] = {}
        self._damaged: dict[Path, str] = {}  # path -> why requests are refused
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self.found_damaged: list[Path] = []  # every file found damaged in this process, repaired or not
        self._on_damage: list[weakref.WeakMethod] = []

    def watch(self, path: Path, rebuild: Callable[[Path], None]) -> None:
        """Hash ``path`` (a derived file the process has just mapped, with a sidecar record) soon,
        and again every ``recheck_s``; ``rebuild(dest)`` writes it afresh to ``dest`` when it is
        damaged. A file loaded again after a rebuild (a new inode) is watched afresh."""
        path = Path(path).resolve()
        inode = path.stat().st_ino
        with self._lock:
            known = self._files.get(path)
            if known is None or known.inode != inode:
                self._files[path] = Watched(path, rebuild, inode)
                self._damaged.pop(path, None)  # that was the replaced file's mapping
            self._lock.notify_all()
        if self.background:
            self._start()

    def on_damage(self, forget: Callable[[], None]) -> None:
        """Call the bound method ``forget`` when a file is found damaged: what was computed from
        the damaged weights (kept prefix caches) must not outlive them. Held weakly."""
        self._on_damage.append(weakref.WeakMethod(forget))

    def check(self) -> None:
        """Raise ``DamagedCacheError`` while a mapped file is known damaged (decoding would give
        wrong output); a cheap read, called before every decode step."""
        if self._damaged:
            raise DamagedCacheError(next(iter(self._damaged.values())))

    def verify_now(self) -> list[Path]:
        """Hash (and repair) in the calling thread every file not hashed since it was registered,
        and return every file found damaged in this process: a short-lived command's output may
        have come from one, so it must not report success."""
        while (item := self._claim(due_only=False, pending_only=True)) is not None:
            self._verify(item)
        with self._lock:  # one the background thread is hashing
            self._lock.wait_for(lambda: not any(w.busy for w in self._files.values()))
        return list(self.found_damaged)

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._run, name="specdecode-cache-watch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:  # Linux threads are tasks: this lowers this thread only
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (AttributeError, OSError):
            pass
        while True:
            item = self._claim(due_only=True, pending_only=False)
            if item is None:
                with self._lock:
                    self._lock.wait(timeout=self._next_due())
                continue
            self._verify(item)

    def _claim(self, due_only: bool, pending_only: bool) -> Watched | None:
        now = time.monotonic()
        with self._lock:
            for w in self._files.values():
                if w.busy or (pending_only and w.checked_at is not None):
                    continue
                if due_only and w.checked_at is not None and now - w.checked_at < self.recheck_s:
                    continue
                w.busy = True
                return w
        return None

    def _next_due(self) -> float:
        now = time.monotonic()
        with self._lock:
            waits = [self.recheck_s - (now - w.checked_at) for w in self._files.values()
                     if w.checked_at is not None and not w.busy]
        return max(min(waits, default=self.recheck_s), 1.0)

    def _verify(self, w: Watched) -> None:
        try:
            record = checks.read_sidecar(w.path)
            if record is None or not w.path.is_file() or w.path.stat().st_ino != w.inode:
                return  # unrecorded (an older version's file), or gone or replaced since it was mapped
            if checks.hash_file(w.path) != record:
                self._repair(w)
        except Exception as exc:  # noqa: BLE001 - a watch must never take the process down
            log.warning(f"specdecode: could not check {w.path.name}: {exc}")
            if w.path in self._damaged:
                self._damaged[w.path] = (f"the cached weights {w.path.name} are damaged and could not be "
                                         f"rebuilt ({str(exc)[:120]}); run `specdecode models verify` and restart")
        finally:
            with self._lock:
                w.checked_at, w.busy = time.monotonic(), False
                self._lock.notify_all()

    def _repair(self, w: Watched) -> None:
        name = w.path.name
        self.found_damaged.append(w.path)
        self._damaged[w.path] = (f"the cached weights {name} were damaged (their SHA-256 differs from the "
                                 "record written with them); they are being rebuilt from the model's source, "
                                 "retry in a minute")
        log.error(f"specdecode: {name} does not match its recorded checksum; refusing requests while it is rebuilt")
        for ref in self._on_damage:
            if (forget := ref()) is not None:
                forget()
        fresh = partial_path(w.path, "building")
        try:
            w.rebuild(fresh)
            record = checks.hash_file(fresh)
            if fresh.stat().st_size != w.path.stat().st_size:
                checks.write_sidecar(w.path, record)
                os.replace(fresh, w.path)  # this process keeps the damaged mapping: it must restart
                self._damaged[w.path] = (f"the cached weights {name} were damaged and rebuilt with a new "
                                         "layout; restart the process to load them")
                return
            _copy_in_place(fresh, w.path)
            checks.write_sidecar(w.path, record)
            if checks.hash_file(w.path) == record:
                del self._damaged[w.path]
                log.warning(f"specdecode: {name} repaired in place; serving again")
        finally:
            release_pool()  # the rebuild's parallel torch work must leave no pool beside the stepping thread's
            fresh.unlink(missing_ok=True)
            checks.sidecar(fresh).unlink(missing_ok=True)


def _copy_in_place(src: Path, dest: Path) -> None:
    """Overwrite the chunks of ``dest`` that differ from ``src`` (same size), through its inode,
    so every shared mapping of ``dest`` sees the new bytes."""
    with open(src, "rb") as s, open(dest, "r+b") as d:
        offset = 0
        while chunk := s.read(_CHUNK):
            if d.read(len(chunk)) != chunk:
                d.seek(offset)
                d.write(chunk)
            offset += len(chunk)
            d.seek(offset)
        d.flush()
        os.fsync(d.fileno())


# The process's mapped files are the process's: one watch for all of them. SPECDECODE_CACHE_WATCH=0
# turns the background hashing off (``verify_now`` and ``specdecode models verify`` still hash).
WATCH = CacheWatch(background=os.environ.get("SPECDECODE_CACHE_WATCH", "1") != "0")
