"""Atomic writes leave the old version or the whole new one; leftovers of killed writers are removed
by the next run, a live writer's are kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specdecode.files import atomic_path, partial_path, recover, remove_stale_partials, write_folder


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_dead_writers_leftovers_are_removed(tmp_path: Path) -> None:
    dead = _dead_pid()
    stale = [tmp_path / f".model.safetensors.{dead}.partial", tmp_path / f".x.{dead}.data",
             tmp_path / f".x.{dead}.joined.gguf"]
    for path in stale:
        path.write_bytes(b"half")
    stale_dir = tmp_path / f".store.1a2b3c4d.{dead}.building"
    stale_dir.mkdir()
    (stale_dir / "tokens.npy").write_bytes(b"half")
    live = partial_path(tmp_path / "model.safetensors")  # this process: still writing
    live.write_bytes(b"in progress")
    keep = [tmp_path / "model.safetensors", tmp_path / ".hidden", tmp_path / f".y.{dead}.lock"]
    for path in keep:
        path.write_bytes(b"mine")
    removed = remove_stale_partials(tmp_path)
    assert sorted(removed) == sorted(stale + [stale_dir])
    assert live.exists() and all(p.exists() for p in keep)
    assert remove_stale_partials(tmp_path / "missing") == []


def test_index_build_cleans_a_killed_builds_folder(tmp_path: Path) -> None:
    from specdecode.index.build import build_datastore

    leftover = tmp_path / f".store.deadbeef.{_dead_pid()}.building"
    leftover.mkdir()
    build_datastore([np.array([1, 2, 3, 4], dtype=np.int32)], tmp_path / "store", vocab_size=16,
                    tokenizer_fingerprint="t")
    assert not leftover.exists() and (tmp_path / "store").is_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["store"]


def test_partial_path_names_the_writer() -> None:
    path = partial_path(Path("/cache/packed/m.safetensors"))
    assert path.parent == Path("/cache/packed") and path.name == f".m.safetensors.{os.getpid()}.partial"


@pytest.mark.parametrize("sync", [True, False])
def test_atomic_path_replaces_the_file_only_when_the_block_succeeds(tmp_path: Path, sync: bool) -> None:
    target = tmp_path / "sub" / "config.json"
    with atomic_path(target, sync=sync) as tmp:
        assert tmp.parent == target.parent and not target.exists()  # made the folder, wrote nothing yet
        tmp.write_text("one")
    assert target.read_text() == "one"
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target, sync=sync) as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert target.read_text() == "one" and [p.name for p in target.parent.iterdir()] == ["config.json"]


def test_write_folder_swaps_a_whole_folder_in(tmp_path: Path) -> None:
    dest = tmp_path / "checkpoint"
    write_folder(dest, lambda folder: (folder / "state.pt").write_text("one"))
    with pytest.raises(OSError):
        write_folder(dest, lambda folder: ((folder / "state.pt").write_text("half"), _fail()))
    assert (dest / "state.pt").read_text() == "one" and [p.name for p in tmp_path.iterdir()] == ["checkpoint"]
    write_folder(dest, lambda folder: (folder / "state.pt").write_text("two"))
    assert (dest / "state.pt").read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["checkpoint"]


def test_recover_puts_back_a_folder_cut_between_its_renames(tmp_path: Path) -> None:
    dest = tmp_path / "checkpoint"
    old = partial_path(dest, "old")
    old.mkdir()
    (old / "state.pt").write_text("one")
    recover(dest)
    assert (dest / "state.pt").read_text() == "one" and not old.exists()


def _fail() -> None:
    raise OSError(28, "No space left on device")
