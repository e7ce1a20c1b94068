"""A tokenizer's identity, so a datastore is never read with a model whose ids mean other text.

Token ids are only meaningful for the tokenizer that produced them: drafting from a store built
with another vocabulary would propose garbage (still lossless, but never accepted). The
fingerprint hashes the whole vocabulary (id -> token text) and the encodings of a few probe
texts, which also catches a changed pre-tokenizer or merges; it does not depend on how the
`tokenizers` library happens to serialize tokenizer.json.
"""

from __future__ import annotations

import hashlib
import json
import weakref

from specdecode.tokenizer import Tokenizer

_PROBES = (
    "def main(argv: list[str]) -> int:\n    return 0\n",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "  indented\ttabs\r\nand   spaces  ",
    "Ünïcödé — 中文 日本語 한국어 🙂",
)
_CACHE: weakref.WeakKeyDictionary[Tokenizer, str] = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """Hex sha256 of the vocabulary and probe encodings (cached per tokenizer object)."""
    cached = _CACHE.get(tokenizer)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    for text, index in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{index}\t{text}\n".encode("utf-8", "surrogatepass"))
    for probe in _PROBES:
        digest.update(json.dumps(tokenizer.encode(probe)).encode())
    fingerprint = digest.hexdigest()
    _CACHE[tokenizer] = fingerprint
    return fingerprint
