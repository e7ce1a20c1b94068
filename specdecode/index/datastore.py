"""A retrieval datastore on disk: token ids, their suffix array, and what produced them.

Layout of a store directory (written by ``specdecode index build``, see ``build.py``)::

    tokens.npy        int32 [n]  documents' token ids, each document followed by SEPARATOR
    suffix_array.npy  int32 [m]  sorted suffixes of tokens, minus those starting with SEPARATOR
                                 (int64 when n >= 2^31)
    meta.json         format version, vocabulary size, tokenizer fingerprint, counts, date

Both arrays are opened with ``mmap_mode="r"``: opening a store of any size is instant and only
the pages a look-up touches are read (a look-up touches O(log n) of them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specdecode.errors import DatastoreError
from specdecode.index.fingerprint import tokenizer_fingerprint
from specdecode.index.matches import copy_run, most_frequent
from specdecode.index.suffix_array import SuffixIndex
from specdecode.tokenizer import Tokenizer

FORMAT_NAME = "specdecode-datastore"
FORMAT_VERSION = 1
SEPARATOR = -1  # after each document; no context contains it, so no match spans documents
TOKENS_FILE, SA_FILE, META_FILE = "tokens.npy", "suffix_array.npy", "meta.json"
SAMPLE_CAP = 4096  # next-token counts use at most this many occurrences, evenly spread


@dataclass(frozen=True)
class DatastoreMeta:
    vocab_size: int
    tokenizer_fingerprint: str
    num_files: int
    num_tokens: int  # document tokens, separators excluded
    created: str  # ISO 8601, UTC
    model: str = ""  # the --model the tokenizer came from (informational)
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def read(cls, path: Path) -> DatastoreMeta:
        try:
            raw: dict[str, Any] = json.loads((path / META_FILE).read_text())
        except FileNotFoundError:
            raise DatastoreError(f"{path} is not a datastore (no {META_FILE}); build one with "
                                 "`specdecode index build`") from None
        except (OSError, ValueError) as exc:
            raise DatastoreError(f"cannot read {path / META_FILE}: {exc}") from exc
        if raw.get("format") != FORMAT_NAME:
            raise DatastoreError(f"{path} is not a specdecode datastore ({META_FILE} has no format "
                                 f"{FORMAT_NAME!r})")
        if raw.get("version") != FORMAT_VERSION:
            raise DatastoreError(f"datastore {path} has format version {raw.get('version')}, this specdecode "
                                 f"reads version {FORMAT_VERSION}; rebuild it with `specdecode index build`")
        try:
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        except TypeError as exc:
            raise DatastoreError(f"{path / META_FILE} is incomplete: {exc}") from exc


def is_datastore(path: Path) -> bool:
    """Whether ``path`` holds a datastore's meta.json (safe to replace with ``--force``)."""
    try:
        return json.loads((Path(path) / META_FILE).read_text()).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


class Datastore:
    """A memory-mapped store; ``match`` finds the longest context suffix in it."""

    def __init__(self, path: Path, meta: DatastoreMeta, tokens: np.ndarray, sa: np.ndarray) -> None:
        self.path, self.meta = path, meta
        self.index = SuffixIndex(tokens, sa)

    @classmethod
    def open(cls, path: str | Path, tokenizer: Tokenizer | None = None) -> Datastore:
        """Open the store at ``path``; with ``tokenizer``, refuse one built for another tokenizer."""
        path = Path(path).expanduser()
        if not path.is_dir():
            raise DatastoreError(f"no datastore at {path}; build one with `specdecode index build`")
        meta = DatastoreMeta.read(path)
        try:
            tokens = np.load(path / TOKENS_FILE, mmap_mode="r")
            sa = np.load(path / SA_FILE, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise DatastoreError(f"datastore {path} is damaged ({exc}); rebuild it") from exc
        if tokens.ndim != 1 or sa.ndim != 1 or len(sa) > len(tokens) or tokens.dtype != np.int32 \
                or sa.dtype not in (np.int32, np.int64):
            raise DatastoreError(f"datastore {path} is damaged (unexpected array shapes or types); rebuild it")
        store = cls(path, meta, tokens, sa)
        if tokenizer is not None:
            store.check_tokenizer(tokenizer)
        return store

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Raise DatastoreError unless the store's token ids mean the same text for ``tokenizer``."""
        if self.meta.vocab_size != tokenizer.vocab_size or \
                self.meta.tokenizer_fingerprint != tokenizer_fingerprint(tokenizer):
            raise DatastoreError(
                f"datastore {self.path} was built with another tokenizer (vocabulary "
                f"{self.meta.vocab_size}, model {self.meta.model or 'unknown'!r}) than this model's "
                f"(vocabulary {tokenizer.vocab_size}); rebuild it with `specdecode index build ... "
                "--model <this model>`"
            )

    def match(self, context: Sequence[int], min_len: int, max_len: int) -> StoreMatch | None:
        """The longest suffix of ``context`` (``min_len`` <= length <= ``max_len``) in the store."""
        length, lo, hi = self.index.longest_suffix_match(context, min_len, max_len)
        return StoreMatch(length, self.index, lo, hi) if length else None


@dataclass(frozen=True, slots=True)
class StoreMatch:
    """Suffix-array rows [lo, hi) whose suffixes start with the matched ``length`` tokens."""

    length: int
    index: SuffixIndex
    lo: int
    hi: int

    def continuation(self, k: int, min_share: float = 0.0) -> list[int]:
        index, lo, hi, depth = self.index, self.lo, self.hi, self.length
        out: list[int] = []
        while len(out) < k:
            if hi - lo == 1:  # one occurrence left: copy what follows it, up to the document's end
                out += copy_run(index.tokens, int(index.sa[lo]) + depth, k - len(out))
                break
            token, share = most_frequent(index.next_tokens(lo, hi, depth, SAMPLE_CAP))
            if token < 0 or share < min_share:
                break
            out.append(token)
            lo, hi = index.narrow(lo, hi, depth, token)
            depth += 1
        return out
