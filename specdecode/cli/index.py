"""``specdecode index build|info``: turn folders of text into a datastore for the suffix drafter.

Each file is one document, tokenized with the model's tokenizer (only the tokenizer is loaded,
never the weights). Hidden files and folders (``.git``, ``.venv``, ...) are skipped, and so are
files that are binary or not UTF-8, counted in the summary.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from specdecode.config import DEFAULT_MODEL
from specdecode.errors import DatastoreError

_SKIP_DIRS = frozenset({"__pycache__", "node_modules"})
_SNIFF_BYTES = 8192  # a NUL byte in the first 8 KiB marks a binary file, as git decides


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="index_command", required=True, metavar="ACTION")
    build = sub.add_parser("build", help="index text files into a datastore for --method suffix",
                           description="Tokenize text files and build a suffix-array datastore.")
    build.add_argument("paths", nargs="+", metavar="PATH", help="files and folders to index (folders recursively)")
    build.add_argument("-o", "--output", required=True, metavar="STORE",
                       help="the datastore folder to create")
    build.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME_OR_PATH",
                       help="whose tokenizer to use: a catalog name, HF folder or .gguf file; use the model you "
                            "will generate with; its weights are not loaded (default: %(default)s)")
    build.add_argument("--ext", default=None, metavar="EXTS",
                       help="comma-separated file extensions to take from folders, e.g. py,md,txt "
                            "(default: every text file; files named explicitly are always taken)")
    build.add_argument("--force", action="store_true", help="replace an existing datastore at STORE")
    build.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    build.set_defaults(run=run_build)
    info = sub.add_parser("info", help="show what a datastore holds",
                          description="Print a datastore's metadata and size.")
    info.add_argument("store", metavar="STORE", help="a datastore folder made by `specdecode index build`")
    info.set_defaults(run=run_info)


def run_build(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specdecode.index import build_datastore, tokenizer_fingerprint
    from specdecode.index.build import check_destination
    from specdecode.models.catalog import resolve_model
    from specdecode.tokenizer import Tokenizer

    started = time.perf_counter()
    out = Path(args.output).expanduser()
    check_destination(out, args.force)  # before any slow work
    files = find_files([Path(p).expanduser() for p in args.paths], parse_exts(args.ext), exclude=out)
    model = args.model
    tokenizer = Tokenizer.from_dir(resolve_model(model, progress=not args.no_progress))
    documents: list[np.ndarray] = []
    skipped = 0
    for path in tqdm(files, desc="tokenizing", unit="file", file=sys.stderr, disable=args.no_progress):
        text = read_text(path)
        if text is None:
            skipped += 1
            continue
        documents.append(np.asarray(tokenizer.encode(text), dtype=np.int32))
    if not documents or not any(len(d) for d in documents):
        raise DatastoreError(f"nothing to index: {len(files)} files found, {skipped} of them binary or not "
                             "UTF-8, no text tokens; check the paths and --ext")
    with tqdm(total=1, desc="sorting suffixes", unit="suffix", unit_scale=True, file=sys.stderr,
              disable=args.no_progress) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        meta = build_datastore(documents, out, vocab_size=tokenizer.vocab_size,
                               tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), model=str(model),
                               force=args.force, progress=progress)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"indexed {meta.num_files} files ({skipped} skipped: binary or not UTF-8), {meta.num_tokens:,} tokens, "
          f"{size / 2**20:.1f} MiB in {time.perf_counter() - started:.1f} s -> {out}")
    return 0


def run_info(args: argparse.Namespace) -> int:
    from specdecode.index import Datastore

    store = Datastore.open(args.store)
    meta = store.meta
    size = sum(f.stat().st_size for f in store.path.iterdir())
    print(f"datastore {store.path}: {meta.num_files} files, {meta.num_tokens:,} tokens, {size / 2**20:.1f} MiB; "
          f"vocabulary {meta.vocab_size} (model {meta.model or 'unknown'}), created {meta.created}, "
          f"format v{meta.version}")
    return 0


def parse_exts(text: str | None) -> frozenset[str] | None:
    """"py, .md,TXT" -> {".py", ".md", ".txt"}; None (or empty) means every extension."""
    if not text:
        return None
    exts = frozenset("." + e.strip().lstrip(".").lower() for e in text.split(",") if e.strip().lstrip("."))
    if not exts:
        raise DatastoreError(f"--ext {text!r} names no extension; give e.g. --ext py,md,txt")
    return exts


def find_files(paths: list[Path], exts: frozenset[str] | None, exclude: Path | None = None) -> list[Path]:
    """Files under ``paths`` in a stable order: explicit files always, folder files by extension."""
    files: list[Path] = []
    for path in paths:
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(f for f in _walk(path, exclude) if exts is None or f.suffix.lower() in exts)
        else:
            raise DatastoreError(f"{'not a regular file or folder' if path.exists() else 'no such file or folder'}: {path}")
    unique = list(dict.fromkeys(files))  # a file named twice is indexed once
    if not unique:
        raise DatastoreError(f"no files found in {', '.join(map(str, paths))}"
                             + (f" with extensions {', '.join(sorted(exts))}" if exts else ""))
    return unique


def _walk(folder: Path, exclude: Path | None) -> Iterator[Path]:
    skip = exclude.resolve() if exclude is not None else None
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(".") or entry.name in _SKIP_DIRS or entry.resolve() == skip:
            continue
        if entry.is_dir() and not entry.is_symlink():  # symlinked folders could loop
            yield from _walk(entry, exclude)
        elif entry.is_file():
            yield entry


def read_text(path: Path) -> str | None:
    """The file's text, or None if it is binary, not UTF-8 or unreadable."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:_SNIFF_BYTES]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None
