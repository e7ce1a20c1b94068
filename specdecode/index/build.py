"""Writing a datastore atomically: a failed or interrupted build leaves no half-written store.

Everything is written into a hidden temporary directory next to the destination and renamed
into place at the end; a rename within one file system is atomic, so readers see either the
old store or the complete new one. Replacing an existing store (``force``) renames the old one
aside first and deletes it after the swap; a directory that is not a datastore is never
replaced, so a mistyped ``-o`` cannot delete someone's files.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from specdecode.errors import DatastoreError
from specdecode.files import partial_path, remove_stale_partials
from specdecode.index.datastore import (META_FILE, SA_FILE, SEPARATOR, TOKENS_FILE, DatastoreMeta,
                                        is_datastore)
from specdecode.index.suffix_array import SortProgress, build_suffix_array


def check_destination(out: Path, force: bool) -> None:
    """Fail early (before any tokenizing) if ``out`` may not be written."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not out.is_dir() or not is_datastore(out):
            raise DatastoreError(f"{out} exists and is not a datastore; choose another output path")
        if not force:
            raise DatastoreError(f"datastore {out} already exists; pass --force to replace it")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise DatastoreError(f"cannot write {out}: {parent} is not a writable folder")


def concatenate(documents: Sequence[np.ndarray]) -> np.ndarray:
    """All documents as one int32 array, each followed by SEPARATOR."""
    total = sum(len(d) + 1 for d in documents)
    tokens = np.empty(total, dtype=np.int32)
    at = 0
    for doc in documents:
        tokens[at : at + len(doc)] = doc
        tokens[at + len(doc)] = SEPARATOR
        at += len(doc) + 1
    return tokens


def build_datastore(
    documents: Sequence[np.ndarray],
    out: str | Path,
    *,
    vocab_size: int,
    tokenizer_fingerprint: str,
    model: str = "",
    force: bool = False,
    progress: SortProgress | None = None,
) -> DatastoreMeta:
    """Index ``documents`` (token id arrays, one per file) into a new store at ``out``."""
    out = Path(out).expanduser()
    check_destination(out, force)
    tokens = concatenate(documents)
    sa = build_suffix_array(tokens, progress)
    sa = sa[tokens[sa] != SEPARATOR]  # a pattern never starts with a separator
    meta = DatastoreMeta(
        vocab_size=vocab_size, tokenizer_fingerprint=tokenizer_fingerprint, num_files=len(documents),
        num_tokens=int(len(tokens) - len(documents)), model=model,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    tmp = partial_path(out.parent / f"{out.name}.{uuid.uuid4().hex[:8]}", "building")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(out.parent)  # a killed build's folder
        tmp.mkdir()
        np.save(tmp / TOKENS_FILE, tokens)
        np.save(tmp / SA_FILE, sa)
        (tmp / META_FILE).write_text(meta.to_json())  # last: a store without meta is not a store
        _swap_into_place(tmp, out, force)
    except OSError as exc:
        raise DatastoreError(f"cannot write datastore {out}: {exc.strerror or exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful swap
    return meta


def _swap_into_place(tmp: Path, out: Path, force: bool) -> None:
    if not out.exists():
        os.rename(tmp, out)
        return
    check_destination(out, force)  # someone may have created it while we were sorting
    old = partial_path(out.parent / f"{out.name}.{uuid.uuid4().hex[:8]}", "old")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(old, out)  # put the previous store back
        raise
    shutil.rmtree(old, ignore_errors=True)
