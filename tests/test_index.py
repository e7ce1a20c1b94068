"""Retrieval indexes: suffix arrays, n-gram tables, the on-disk datastore and `specdecode index`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.errors import DatastoreError
from specdecode.index import (Datastore, NgramTable, SuffixIndex, build_datastore, build_suffix_array,
                              tokenizer_fingerprint)
from specdecode.index import build as build_module
from specdecode.tokenizer import Tokenizer

token_lists = st.lists(st.integers(-1, 3), max_size=80)


def _occurrences(tokens: list[int], pattern: list[int]) -> set[int]:
    m = len(pattern)
    return {i for i in range(len(tokens) - m + 1) if tokens[i : i + m] == pattern}


@settings(max_examples=300, deadline=None)
@given(token_lists)
def test_suffix_array_matches_brute_force(tokens):
    sa = build_suffix_array(np.array(tokens, dtype=np.int32))
    assert sa.tolist() == sorted(range(len(tokens)), key=lambda i: tokens[i:])
    assert sa.dtype == np.int32


def test_suffix_array_on_long_repeats():
    rng = np.random.default_rng(0)
    tokens = np.tile(rng.integers(0, 5, 50), 20)  # many rounds of doubling
    sa = build_suffix_array(tokens)
    listed = tokens.tolist()
    assert sa.tolist() == sorted(range(len(listed)), key=lambda i: listed[i:])


@settings(max_examples=200, deadline=None)
@given(token_lists, st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_find_is_exactly_the_occurrences(tokens, pattern):
    arr = np.array(tokens, dtype=np.int32)
    index = SuffixIndex(arr, build_suffix_array(arr))
    lo, hi = index.find(pattern)
    assert {int(index.sa[i]) for i in range(lo, hi)} == _occurrences(tokens, pattern)
    longer = pattern + [pattern[0]]  # extending a pattern narrows its range: search inside it
    assert index.find(longer, lo, hi) == index.find(longer)
    assert index.narrow(lo, hi, len(pattern), pattern[0]) == index.find(longer)


@settings(max_examples=200, deadline=None)
@given(token_lists, st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_longest_suffix_match_is_longest(tokens, context):
    arr = np.array(tokens, dtype=np.int32)
    length, lo, hi = SuffixIndex(arr, build_suffix_array(arr)).longest_suffix_match(context, 2, 8)
    expected = max((n for n in range(2, min(8, len(context)) + 1) if _occurrences(tokens, context[-n:])),
                   default=0)
    assert length == expected
    assert (hi - lo) == (len(_occurrences(tokens, context[-length:])) if length else 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=15), max_size=5),
       st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_ngram_table_finds_longest_match_with_a_continuation(chunks, context):
    table = NgramTable(levels=(2, 4))
    for chunk in chunks:  # appended in pieces, as a growing request is
        table.extend(chunk)
    tokens = [t for c in chunks for t in c]
    match = table.match(context, 2, 10)

    def continued(n: int) -> set[int]:  # ends of occurrences with a token after them
        return {i + n for i in _occurrences(tokens, context[-n:]) if i + n < len(tokens)}

    expected = max((n for n in range(2, min(10, len(context)) + 1) if continued(n)), default=0)
    if expected == 0:
        assert match is None
    else:
        assert match is not None and match.length == expected
        assert set(match.ends.tolist()) == continued(expected)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-1, 3), max_size=40), st.lists(st.integers(0, 3), min_size=2, max_size=6),
       st.integers(1, 12))
def test_ngram_table_continues_with_the_most_frequent_next_token(tokens, context, k):
    """The most frequent next token over the occurrences left (ties: the latest), narrowed to
    those that took it, until a document end (-1) or the buffer's end; checked by brute force."""
    table = NgramTable(levels=(2, 4))
    table.extend(tokens)
    match = table.match(context, 2, 10)
    if match is None:
        return
    out, pos = [], sorted(match.ends.tolist())
    while len(out) < k and pos:
        nexts = [tokens[q] if q < len(tokens) else -2 for q in pos]
        top = max(nexts.count(t) for t in nexts)
        token = [t for t in nexts if nexts.count(t) == top][-1]
        if token < 0:
            break
        out.append(token)
        pos = [q + 1 for q, t in zip(pos, nexts) if t == token]
    assert match.continuation(k) == out


def _store(tmp_path: Path, docs: list[list[int]], name: str = "store", **kw) -> Path:
    out = tmp_path / name
    build_datastore([np.array(d, dtype=np.int32) for d in docs], out, vocab_size=kw.pop("vocab_size", 10),
                    tokenizer_fingerprint=kw.pop("fingerprint", "fp"), **kw)
    return out


def test_lookup_takes_longest_match_and_most_frequent_continuation(tmp_path):
    store = Datastore.open(_store(tmp_path, [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [9, 1, 2, 7]]))
    match = store.match([0, 1, 2], 2, 32)
    assert match.length == 2  # "0 1 2" never occurs, "1 2" four times
    assert match.continuation(8) == [3, 5]  # 3 follows 3 of 4; then 5 follows 2 of 3; then a document ends
    assert match.continuation(1) == [3]
    assert match.continuation(8, min_share=0.7) == [3]  # 5's share (2/3) is below 0.7
    longer = store.match([9, 1, 2], 2, 32)
    assert longer.length == 3 and longer.continuation(8) == [7]
    assert store.match([8, 8], 2, 32) is None
    assert store.match([0, 1], 2, 32) is None  # "1" occurs but is shorter than min_len


def test_continuation_stops_at_document_end(tmp_path):
    store = Datastore.open(_store(tmp_path, [[1, 2, 3], [4, 5, 6, 7, 8]]))
    assert store.match([1, 2], 2, 32).continuation(8) == [3]
    assert store.match([4, 5], 2, 32).continuation(2) == [6, 7]


def test_build_and_load_round_trip_memory_mapped(tmp_path):
    docs = [[1, 2, 3], [], [3, 2, 1, 0]]
    out = _store(tmp_path, docs, vocab_size=4, fingerprint="abc", model="tiny")
    store = Datastore.open(out)
    assert isinstance(store.index.tokens, np.memmap) and isinstance(store.index.sa, np.memmap)
    assert store.index.tokens.tolist() == [1, 2, 3, -1, -1, 3, 2, 1, 0, -1]
    tokens = store.index.tokens.tolist()
    expected = [i for i in sorted(range(len(tokens)), key=lambda i: tokens[i:]) if tokens[i] != -1]
    assert store.index.sa.tolist() == expected
    meta = store.meta
    assert (meta.vocab_size, meta.tokenizer_fingerprint, meta.num_files, meta.num_tokens, meta.model) == (
        4, "abc", 3, 7, "tiny")
    assert json.loads((out / "meta.json").read_text())["version"] == 1


def test_build_refuses_to_overwrite_without_force(tmp_path):
    out = _store(tmp_path, [[1, 2]])
    with pytest.raises(DatastoreError, match="--force"):
        _store(tmp_path, [[3, 4]])
    assert Datastore.open(out).index.tokens.tolist() == [1, 2, -1]
    _store(tmp_path, [[3, 4]], force=True)
    assert Datastore.open(out).index.tokens.tolist() == [3, 4, -1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # the old one is gone


def test_build_never_replaces_something_that_is_not_a_store(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("precious")
    (tmp_path / "file").write_text("x")
    for name in ("notes", "file"):
        with pytest.raises(DatastoreError, match="not a datastore"):
            _store(tmp_path, [[1, 2]], name=name, force=True)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_failed_build_leaves_nothing_half_written(tmp_path, monkeypatch, failure):
    old = _store(tmp_path, [[1, 2]])

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(build_module, "_swap_into_place", fail)
    expected = DatastoreError if isinstance(failure, OSError) else KeyboardInterrupt
    with pytest.raises(expected):
        _store(tmp_path, [[5, 6]], name="new")
    with pytest.raises(expected):
        _store(tmp_path, [[5, 6]], force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # no temp dir, no partial "new"
    assert Datastore.open(old).index.tokens.tolist() == [1, 2, -1]


def test_open_reports_bad_stores(tmp_path):
    with pytest.raises(DatastoreError, match="no datastore"):
        Datastore.open(tmp_path / "missing")
    with pytest.raises(DatastoreError, match="not a datastore"):
        Datastore.open(tmp_path)
    out = _store(tmp_path, [[1, 2]])
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(DatastoreError, match="version 99"):
        Datastore.open(out)


def _other_tokenizer(source: Path) -> Tokenizer:
    """The tiny tokenizer plus one added token: the same ids for bytes, another vocabulary."""
    tok = Tokenizer.from_dir(source)
    tok.backend.add_tokens(["<extra>"])
    return Tokenizer(tok.backend, eos_token_ids=tok.eos_token_ids, bos_token_id=None, chat_template=None)


def test_fingerprint_mismatch_is_a_named_error(tmp_path, tiny_pair):
    target, draft = tiny_pair
    tok = Tokenizer.from_dir(target)
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(Tokenizer.from_dir(draft))  # same files
    out = _store(tmp_path, [tok.encode("hello world")], vocab_size=tok.vocab_size,
                 fingerprint=tokenizer_fingerprint(tok))
    Datastore.open(out, tokenizer=tok)  # the right tokenizer is accepted
    other = _other_tokenizer(target)
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tok)
    with pytest.raises(DatastoreError, match="another tokenizer"):
        Datastore.open(out, tokenizer=other)
    # Same vocabulary size, different fingerprint (e.g. other merges): refused as well.
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "tokenizer_fingerprint": "0" * 64}))
    with pytest.raises(DatastoreError, match="another tokenizer"):
        Datastore.open(out, tokenizer=tok)


# --- the CLI -----------------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "a.py").write_text("def add(a, b):\n    return a + b\n")
    (root / "sub" / "b.md").write_text("# Notes\nadd numbers\n")
    (root / ".git" / "config").write_text("hidden, skipped\n")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    return root


def _cli(*args: str) -> int:
    from specdecode.cli import main

    return main(list(args))


def test_cli_index_build_end_to_end(tiny_pair, corpus, tmp_path, capsys):
    target, _ = tiny_pair
    out = tmp_path / "store"
    assert _cli("index", "build", str(corpus), "-o", str(out), "--model", str(target), "--no-progress") == 0
    summary = capsys.readouterr().out
    assert "indexed 2 files (2 skipped" in summary and str(out) in summary
    tok = Tokenizer.from_dir(target)
    store = Datastore.open(out, tokenizer=tok)
    tokens = store.index.tokens.tolist()
    texts = [tok.decode(t) for t in _split(tokens)]
    assert texts == ["def add(a, b):\n    return a + b\n", "# Notes\nadd numbers\n"]  # sorted walk order
    assert store.meta.num_files == 2 and store.meta.num_tokens == sum(len(t) for t in texts)  # one byte, one token
    assert store.match(tok.encode("    return a"), 2, 32).continuation(4) == tok.encode(" + b")

    assert _cli("index", "info", str(out)) == 0
    assert "2 files" in capsys.readouterr().out


def _split(tokens: list[int]) -> list[list[int]]:
    docs, current = [], []
    for t in tokens:
        if t == -1:
            docs.append(current)
            current = []
        else:
            current.append(t)
    return docs


def test_cli_index_ext_filter_and_force(tiny_pair, corpus, tmp_path, capsys):
    target, _ = tiny_pair
    out = tmp_path / "store"
    args = ["index", "build", str(corpus), "-o", str(out), "--model", str(target), "--no-progress"]
    assert _cli(*args, "--ext", "md") == 0
    assert Datastore.open(out).meta.num_files == 1
    assert _cli(*args) == 2  # exists, no --force
    assert "--force" in capsys.readouterr().err
    assert _cli(*args, "--force", "--ext", ".PY,md") == 0
    assert Datastore.open(out).meta.num_files == 2


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file or folder"),
    ("empty", "no files found"),
    ("binary_only", "nothing to index"),
    ("output_is_file", "not a datastore"),
])
def test_cli_index_bad_input_exits_2(tiny_pair, tmp_path, capsys, case, message):
    target, _ = tiny_pair
    src, out = tmp_path / "src", tmp_path / "store"
    src.mkdir()
    if case == "missing":
        src = tmp_path / "nope"
    elif case == "binary_only":
        (src / "x.bin").write_bytes(b"\x00\x00")
    elif case == "output_is_file":
        (src / "a.txt").write_text("text")
        out.write_text("a file")
    code = _cli("index", "build", str(src), "-o", str(out), "--model", str(target), "--no-progress")
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (out.is_dir())


def test_cli_index_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        _cli("index", "build", "--help")
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--output", "--model", "--ext", "--force", "--no-progress", "PATH"):
        assert flag in text
