"""Same-size damage to a mapped derived file is found by hashing after load and repaired in place;
decoding is refused meanwhile, and a short command whose output may have come from it fails."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.cli import main
from specdecode.errors import DamagedCacheError
from specdecode.files import specdecode_home
from specdecode.models import checks, watch
from specdecode.models.watch import NICE, WATCH, CacheWatch
from specdecode.server.http_errors import from_spec_error
from tests.gguf_blocks import write_model_gguf

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / f"{tmp_path.name}.gguf"  # one cache name per test
    write_model_gguf(path, {"": "Q4_K"}, seed=11)
    yield path
    WATCH.found_damaged.clear()  # the process's watch outlives the test


def _planes(model: Path) -> Path:
    [planes] = (specdecode_home() / "native").glob(f"{model.stem}-*.safetensors")
    return planes


def _damage(planes: Path) -> None:
    """4 KB of 0xFF in the middle of the planes, in place: same size, same inode."""
    with open(planes, "r+b") as f:
        f.seek(planes.stat().st_size // 2)
        f.write(b"\xff" * 4096)


def _logits(llm: LLM) -> torch.Tensor:
    cache = llm.target.new_cache(16)
    return llm.target.forward(torch.tensor([5, 6, 7]), cache, last_only=True)


def test_damage_after_load_is_found_and_repaired_in_the_live_mapping(model, monkeypatch) -> None:
    llm = LLM(model=str(model), max_seq_len=64, progress=False)
    want, logits = llm.generate("hi", PARAMS)[0].token_ids, _logits(llm)
    planes = _planes(model)
    _damage(planes)
    assert not torch.equal(_logits(llm), logits)  # the running model reads the damaged bytes
    assert len(llm.engine.caches)  # the request's kept prefix
    released: list[int] = []  # the rebuild's thread gives back its OpenMP workers (engine/openmp.py)
    monkeypatch.setattr(watch, "release_pool", lambda: released.append(threading.get_ident()) or True)
    assert WATCH.verify_now() == [planes.resolve()]
    assert released == [threading.get_ident()]
    assert not len(llm.engine.caches)  # computed from the damaged weights: forgotten
    assert checks.hash_file(planes) == checks.read_sidecar(planes)
    WATCH.check()  # repaired: decoding is allowed again
    assert torch.equal(_logits(llm), logits)  # without reloading: the tensors map the file
    assert llm.generate("hi", PARAMS)[0].token_ids == want


def test_decoding_is_refused_while_a_damaged_file_is_rebuilt(model, monkeypatch) -> None:
    llm = LLM(model=str(model), max_seq_len=64, progress=False)
    planes = _planes(model).resolve()
    watched = WATCH._files[planes]
    rebuilding, release = threading.Event(), threading.Event()
    rebuild = watched.rebuild

    def slow_rebuild(dest: Path) -> None:
        rebuilding.set()
        assert release.wait(60)
        rebuild(dest)

    monkeypatch.setattr(watched, "rebuild", slow_rebuild)
    _damage(planes)
    worker = threading.Thread(target=WATCH.verify_now)
    worker.start()
    try:
        assert rebuilding.wait(60)
        with pytest.raises(DamagedCacheError, match="being rebuilt"):
            llm.generate("hi", PARAMS)
    finally:
        release.set()
        worker.join(60)
    assert llm.generate("hi", PARAMS)[0].finish_reason == "length"
    error = from_spec_error(DamagedCacheError("x"))
    assert error.status == 503 and error.headers["Retry-After"]


def test_generate_fails_when_its_weights_were_damaged_at_the_same_size(model, capsys) -> None:
    LLM(model=str(model), max_seq_len=64, progress=False)  # builds the planes
    planes = _planes(model)
    _damage(planes)  # before the command loads them: the size check on load passes
    code = main(["generate", "--model", str(model), "--method", "none", "--max-tokens", "4", "--prompt", "hi"])
    assert code == 1
    assert "were damaged" in capsys.readouterr().err
    assert checks.hash_file(planes) == checks.read_sidecar(planes)


def test_the_background_watch_hashes_soon_at_a_low_priority(tmp_path) -> None:
    path = tmp_path / "derived.bin"
    path.write_bytes(os.urandom(1 << 16))
    checks.write_sidecar(path, checks.hash_file(path))
    watch = CacheWatch()
    watch.watch(path, lambda dest: None)
    watched = watch._files[path.resolve()]
    with watch._lock:
        assert watch._lock.wait_for(lambda: watched.checked_at is not None, timeout=60)
    assert os.getpriority(os.PRIO_PROCESS, watch._thread.native_id) == NICE
    assert watch.found_damaged == []
