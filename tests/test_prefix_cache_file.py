"""Kept prefixes saved to a file and restored in a fresh process: bitwise the output of an uncached
run, refused when damaged, truncated or made for another model or dtype, written atomically, and
restored within the budget (specdecode/models/prefix_file.py)."""

from __future__ import annotations

import http.client
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specdecode import LLM, SamplingParams
from specdecode.cli import main
from specdecode.errors import PrefixCacheFileError
from specdecode.models import prefix_file
from specdecode.models.cache import KVCache
from specdecode.models.prefix_cache import PrefixCache
from tests.conftest import make_tiny_llm
from tests.server_support import wait_until
from tests.test_cli import run_cli

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
DOCUMENT = "system: you answer from this document. def f(x): return x * 2  # doc\n" * 3


def _llm(tiny_pair, **kw) -> LLM:
    target, draft = tiny_pair
    return LLM(model=str(target), draft=str(draft), method="draft_model", max_seq_len=512, progress=False, **kw)


@pytest.fixture(scope="module")
def saved(tiny_pair, tmp_path_factory) -> tuple[Path, list[int]]:
    """A file holding the target's and the draft's prefixes of one request: (path, its tokens)."""
    llm = _llm(tiny_pair)
    out = llm.generate(DOCUMENT, GREEDY)[0]
    path = tmp_path_factory.mktemp("prefixes") / "prefixes.safetensors"
    assert llm.save_prefix_cache(path) == len(out.prompt_token_ids) + len(out.token_ids) - 1
    return path, out.prompt_token_ids + out.token_ids


@pytest.fixture(scope="module")
def uncached(tiny_pair) -> LLM:
    return _llm(tiny_pair, prefix_cache=False)


def _question(llm: LLM, held: list[int]) -> list[int]:
    return held + llm.tokenizer.encode(" and what does f(3) return?")


def test_restored_prefixes_give_bitwise_the_uncached_output_and_count_as_hits_only_when_used(
        tiny_pair, saved, uncached):
    path, held = saved
    llm = _llm(tiny_pair)
    restored = llm.load_prefix_cache(path)
    pool = llm.engine.caches
    with pool.frozen() as entries:
        assert [ids.tolist() for ids, _, _ in entries] == [held[:-1]]
    assert restored > len(held) - 1 and len(llm.draft_prefixes) == 1  # the draft's part too
    assert pool.hits == pool.queries == llm.draft_prefixes.hits == 0
    prompt = _question(llm, held)
    got = llm.generate(prompt, GREEDY)[0]
    want = uncached.generate(prompt, GREEDY)[0]
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
    assert got.stats.cached_tokens == len(held) - 1
    assert llm.draft_prefixes.hits >= len(held) // 2  # the draft model resumed from its restored part


def test_the_file_holds_only_the_held_slots_and_both_parts(saved):
    path, held = saved
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == prefix_file.FORMAT
        assert set(json.loads(meta["parts"])) == {"target", "draft"}
        assert f.get_tensor("target.0.ids").tolist() == held[:-1]
        for part in ("target", "draft"):
            n = f.get_tensor(f"{part}.0.ids").shape[0]
            assert f.get_tensor(f"{part}.0.k").shape[2] == f.get_tensor(f"{part}.0.v").shape[2] == n  # not the capacity


def _damaged(saved, tmp_path: Path, edit) -> Path:
    data = bytearray(saved[0].read_bytes())
    path = tmp_path / "damaged.safetensors"
    path.write_bytes(bytes(edit(data)))
    return path


def _flip_payload(data: bytearray) -> bytearray:
    data[-100] ^= 0x01  # a bit of the last value tensor
    return data


def test_a_flipped_payload_byte_is_refused(tiny_pair, saved, tmp_path):
    llm = _llm(tiny_pair)
    with pytest.raises(PrefixCacheFileError, match="checksum"):
        llm.load_prefix_cache(_damaged(saved, tmp_path, _flip_payload))
    assert len(llm.engine.caches) == 0 and len(llm.draft_prefixes) == 0  # nothing restored


@pytest.mark.parametrize("keep", [0, 5, 300, -1000])
def test_a_truncated_file_is_refused(tiny_pair, saved, tmp_path, keep):
    llm = _llm(tiny_pair)
    with pytest.raises(PrefixCacheFileError, match="truncated|damaged"):
        llm.load_prefix_cache(_damaged(saved, tmp_path, lambda data: data[:keep]))
    assert len(llm.engine.caches) == 0


def test_a_file_for_other_weights_or_another_dtype_is_refused(tiny_pair, saved, tmp_path):
    other = make_tiny_llm(tmp_path / "other", "qwen2", seed=11, tie_word_embeddings=False)  # same shapes
    for llm in (LLM(model=str(other), max_seq_len=512, progress=False),
                LLM(model=str(tiny_pair[0]), dtype="bfloat16", max_seq_len=512, progress=False)):
        with pytest.raises(PrefixCacheFileError, match="another"):
            llm.load_prefix_cache(saved[0])
        assert len(llm.engine.caches) == 0


def test_the_identity_names_the_targets_attention(tiny_pair):
    """A float32 target attends natively (``attend_rows``) where the kernels build, else in torch
    blocks: other bits from the same weights, so a file made under one is not restored under the other."""
    from specdecode.models.attend import attend_blocked

    llm = LLM(model=str(tiny_pair[0]), max_seq_len=64, progress=False)
    assert llm.target.backend.attend.__name__ == "attend_rows"
    native = prefix_file.model_identity(llm.target, tiny_pair[0], None)
    llm.target.backend.attend = attend_blocked
    assert prefix_file.model_identity(llm.target, tiny_pair[0], None) == {**native, "attention": "attend_blocked"}


def test_a_draft_part_for_another_draft_is_skipped_and_the_target_part_restored(tiny_pair, saved, tmp_path,
                                                                                 caplog):
    other = make_tiny_llm(tmp_path / "draft2", "qwen2", seed=12, tie_word_embeddings=False)
    llm = LLM(model=str(tiny_pair[0]), draft=str(other), method="draft_model", max_seq_len=512, progress=False)
    with caplog.at_level(logging.WARNING, logger="specdecode"):
        assert llm.load_prefix_cache(saved[0]) == len(saved[1]) - 1
    assert len(llm.engine.caches) == 1 and len(llm.draft_prefixes) == 0
    assert "draft part was made with another" in caplog.text


def test_a_write_that_fails_midway_leaves_the_previous_file(tiny_pair, saved, tmp_path, monkeypatch):
    path = tmp_path / "prefixes.safetensors"
    path.write_bytes(saved[0].read_bytes())
    before = path.read_bytes()
    llm = _llm(tiny_pair)
    llm.generate("another prompt entirely " * 4, GREEDY)
    real = prefix_file._write

    def fail_midway(f, parts, tensors):
        real(f, parts, tensors[:2])  # a header and part of the data reach the partial file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prefix_file, "_write", fail_midway)
    with pytest.raises(PrefixCacheFileError, match="No space left"):
        llm.save_prefix_cache(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefixes.safetensors"]  # no partial left


# --- one pool, its budget ----------------------------------------------------------------------------


def _pool(caches: int) -> PrefixCache:
    """A pool of one-layer caches of 8-slot blocks whose budget holds ``caches`` blocks."""
    return PrefixCache(lambda capacity: KVCache(1, 1, 4, -(-capacity // 8) * 8), caches * 2 * 8 * 4 * 4)


def _keep(pool: PrefixCache, ids: list[int]) -> None:
    lease = pool.take(ids, len(ids))
    lease.cache.k[:, :, : len(ids)] = torch.tensor(ids, dtype=torch.float32)[:, None]
    lease.cache.length = len(ids)
    pool.release(lease.cache, ids)


def _held(pool: PrefixCache, ids: list[int]) -> int:
    """How many of ``ids`` the pool holds a prefix of (leaving its entries where they are)."""
    return pool.restore(ids + [5], KVCache(1, 1, 4, 32))


def test_entries_beyond_the_budget_are_evicted_or_skipped_without_error(tmp_path):
    source = _pool(8)
    for first in (1, 2, 3):
        _keep(source, [first] * 6)  # a block each
    _keep(source, [4] * 20)  # three blocks, the most recent
    path = tmp_path / "pool.safetensors"
    assert source.save(path, {"model": "m"}) == 3 * 6 + 20
    small = _pool(2)
    assert small.load(path, {"model": "m"}) == 2 * 6  # [4] * 20 is larger than the budget: skipped
    assert [_held(small, [i] * 6) for i in (1, 2, 3)] == [0, 6, 6]  # the least recent evicted
    assert small.used <= small.budget and small.hits == 12  # the probes' hits, none from the load
    three = _pool(3)
    assert three.load(path, {"model": "m"}) == 20  # the most recent entry evicts the older ones
    assert _held(three, [4] * 20) == 20 and len(three) == 1


def test_a_restored_entry_holds_the_saved_keys(tmp_path):
    source = _pool(4)
    _keep(source, [7, 8, 9])
    path = tmp_path / "pool.safetensors"
    source.save(path, {"model": "m"})
    pool = _pool(4)
    pool.load(path, {"model": "m"})
    lease = pool.take([7, 8, 9, 1], 8)
    assert lease.cached == 3
    assert lease.cache.k[0, 0, :3, 0].tolist() == [7.0, 8.0, 9.0]
    with pytest.raises(PrefixCacheFileError, match="model"):
        _pool(4).load(path, {"model": "another"})


# --- the command line ----------------------------------------------------------------------------------


def test_generate_twice_with_a_prefix_cache_file_skips_the_second_prefill(tiny_pair, tmp_path, capsys):
    path = tmp_path / "cli.safetensors"
    args = ["generate", "--model", str(tiny_pair[0]), "--method", "none", "--prompt", DOCUMENT,
            "--max-tokens", "6", "--json", "--prefix-cache-file", str(path)]
    reports = []
    for _ in range(2):
        assert main(args) == 0
        reports.append(json.loads(capsys.readouterr().out))
    first, second = (r["stats"] for r in reports)
    assert first["cached_tokens"] == 0 and path.is_file()
    assert second["cached_tokens"] == second["prompt_tokens"] - 1
    assert reports[0]["token_ids"] == reports[1]["token_ids"]


def test_serve_refuses_a_prefix_cache_file_without_the_cache():
    res = run_cli("serve", "--model", "unused", "--no-prefix-cache", "--prefix-cache-file", "x.safetensors")
    assert res.returncode == 2 and "drop --no-prefix-cache" in res.stderr


def test_serve_with_a_damaged_file_warns_serves_and_saves_at_shutdown(tiny_pair, saved, tmp_path):
    from tests.test_server_cli import free_port

    path = _damaged(saved, tmp_path, _flip_payload)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", "--model", str(tiny_pair[0]),
                             "--method", "none", "--port", str(port), "--max-seq-len", "256",
                             "--log-level", "warning", "--prefix-cache-file", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def completion() -> int | None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/v1/completions", json.dumps({"model": str(tiny_pair[0]), "prompt": "abc abc", "max_tokens": 4}),
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status in (200, 503), response.read()  # 503: still loading
            return response.status
        except OSError:
            assert proc.poll() is None, proc.communicate()[1]
            return None

    try:
        assert wait_until(lambda: completion() == 200, timeout=120)
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert "not restoring the prefix cache" in stderr and "checksum" in stderr, stderr
    assert "Traceback" not in stderr and "saved" in stderr, stderr
    llm = LLM(model=str(tiny_pair[0]), max_seq_len=256, progress=False)
    assert llm.load_prefix_cache(path) > 0  # rewritten whole at shutdown
