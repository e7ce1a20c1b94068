"""The linear kernels give a row the same bits whatever rows share the call."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specdecode.models import kernel_build, kernels

PATHS = {"portable": kernels.linear_invariant_portable, "native": kernels.linear_invariant}


def test_native_kernel_builds_on_this_machine():
    # The development and CI machines have AVX2 and a compiler: the fast path must be there.
    assert kernel_build.cpu_has_avx2_fma()
    assert kernel_build.load() is not None


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("shape", [(40, 24), (136, 96), (37, 1027), (4864, 896)], ids=str)
def test_rows_bitwise_invariant(path, shape):
    linear = PATHS[path]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=gen)
    x = torch.randn(34, shape[1], generator=gen)
    alone = torch.cat([linear(x[i : i + 1], w) for i in range(34)])
    for n in (*range(2, 14), 17, 33):  # every remainder of the 3- and 6-row register tiles
        for start in (0, 1):
            got = linear(x[start : start + n], w)
            assert torch.equal(got, alone[start : start + n]), (path, n, start)
    torch.testing.assert_close(alone, x @ w.T, atol=1e-4, rtol=1e-4)


def test_portable_rows_past_the_prefill_line_stay_invariant_when_asked(monkeypatch):
    """Batched decode rows of many sequences can exceed ``PREFILL_ROWS``; with ``invariant`` the
    portable path (and the int8 target's fallback to it without the native kernel) must still
    give each row its one-row bits rather than one BLAS call's."""
    from specdecode.models.int8_rows import quantize_rows

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(52, 300, generator=gen)
    x = torch.randn(kernels.PREFILL_ROWS + 20, 300, generator=gen)
    alone = torch.cat([kernels.linear_invariant_portable(row[None], w) for row in x])
    assert torch.equal(kernels.linear_invariant_portable(x, w, invariant=True), alone)
    q = quantize_rows(w)
    monkeypatch.setattr(kernel_build, "load", lambda: None)
    alone = torch.cat([kernels.linear_int8_invariant(row[None], q) for row in x])
    assert torch.equal(kernels.linear_int8_invariant(x, q, invariant=True), alone)


def test_native_rows_beyond_one_pass_are_exact():
    """Calls wider than the kernel's one pass (60 rows with AVX-512, 63 with AVX2; batched
    server steps) slice rows, never sums."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(52, 300, generator=gen)
    x = torch.randn(130, 300, generator=gen)
    kernel = kernel_build.load().linear_rows
    alone = torch.cat([kernel(x[i : i + 1], w) for i in range(130)])
    for n in (60, 61, 63, 64, 127, 130):
        assert torch.equal(kernel(x[:n].contiguous(), w), alone[:n]), n


def test_avx2_build_is_invariant_too():
    """CPUs without AVX-512 get the 8-lane build; check it in a subprocess forced to it (the
    flags are part of the build folder's name), since this machine's build may be 16-lane."""
    script = """
import torch
from specdecode.models import kernel_build
k = kernel_build.load()
assert k is not None and k.lanes() == 8, k
g = torch.Generator().manual_seed(2)
w, x = torch.randn(200, 1027, generator=g), torch.randn(13, 1027, generator=g)
alone = torch.cat([k.linear_rows(x[i : i + 1], w) for i in range(13)])
for n in range(2, 14):
    assert torch.equal(k.linear_rows(x[:n].contiguous(), w), alone[:n]), n
torch.testing.assert_close(alone, x @ w.T, atol=1e-4, rtol=1e-4)
"""
    env = {**os.environ, "SPECDECODE_AVX512": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def test_native_build_matches_this_cpu():
    lanes = kernel_build.load().lanes()
    assert lanes == (16 if "-mavx512f" in kernel_build.compile_flags() else 8)


def test_native_rejects_bad_input():
    with pytest.raises(RuntimeError):
        kernels.linear_invariant(torch.ones(2, 3), torch.ones(4, 5))
    with pytest.raises(RuntimeError):
        kernels.linear_invariant(torch.ones(2, 3, dtype=torch.float64), torch.ones(4, 3, dtype=torch.float64))


@pytest.mark.parametrize("group", [1, 2, 3, 6])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_rows_bitwise_invariant(group, head_dim):
    """A query row's output is the same alone (G rows per kv head) as inside a verify batch."""
    gen = torch.Generator().manual_seed(group * head_dim)
    span, n_max = 2 * kernels.KEY_BLOCK, 17
    q = torch.randn(2, group, n_max, head_dim, generator=gen)  # [kv_heads, G, N, d]
    k = torch.randn(2, span, head_dim, generator=gen)
    v = torch.randn(2, span, head_dim, generator=gen)
    start = 150  # cached tokens before the batch; the rest of the span is masked

    def run(first: int, n: int) -> torch.Tensor:
        cols = torch.arange(span)
        visible = cols[None, :] <= (start + first + torch.arange(n))[:, None]
        bias = torch.zeros(n, span).masked_fill_(~visible, float("-inf")).repeat(group, 1)
        rows = q[:, :, first : first + n].reshape(2, group * n, head_dim)
        return kernels.attention(rows, k, v, bias, 0.125).view(2, group, n, head_dim)

    alone = torch.cat([run(i, 1) for i in range(n_max)], dim=2)
    for n in (2, 5, 9, 17):
        assert torch.equal(run(0, n), alone[:, :, :n]), n


@pytest.mark.parametrize("shape", [(64, 40), (77, 13), (1536, 1536), (24, 200)])
def test_int8_rows_bitwise_invariant_and_exact(shape):
    """The int8-target kernel: a row's bits never depend on its companions, and each output is
    the float dot product with the widened weights, times the row's scale."""
    from specdecode.models.int8_rows import quantize_rows

    gen = torch.Generator().manual_seed(5)
    w = quantize_rows(torch.randn(shape, generator=gen))
    x = torch.randn(12, shape[1], generator=gen)
    full = kernels.linear_int8_invariant(x, w, invariant=True)
    for n in range(1, 12):
        for start in (0, 12 - n):
            part = kernels.linear_int8_invariant(x[start : start + n], w, invariant=True)
            assert torch.equal(part, full[start : start + n]), (n, start)
    reference = (x.double() @ w.q.double().T) * w.scale.double()
    torch.testing.assert_close(full.double(), reference, atol=1e-4, rtol=1e-5)


def test_quantize_rows_round_trips_within_half_a_step():
    from specdecode.models.int8_rows import quantize_rows

    w = torch.randn(300, 70, generator=torch.Generator().manual_seed(6))
    q = quantize_rows(w, chunk_rows=128)  # several chunks
    assert q.q.dtype == torch.int8 and q.q.abs().max() <= 127
    assert torch.all((q.dequantize() - w).abs() <= q.scale[:, None] / 2 + 1e-7)
    assert torch.equal(q.q.abs().amax(1), torch.full((300,), 127, dtype=torch.int8))


def test_int4_kernel_builds_on_this_machine():
    """Every development and CI machine has AVX2 (asserted above), so the int4 draft kernel must
    build: its VNNI build where the CPU lists AVX-512 VNNI, its AVX2 build elsewhere."""
    kernel = kernel_build.load_int4()
    assert kernel is not None
    assert kernel.lanes() == (16 if "-mavx512vnni" in kernel_build.int4_flags() else 8)


def test_int4_avx2_build_matches_its_dequantized_weights(tiny_models, tmp_path):
    """The AVX2 build (VPMADDUBSW pairs), checked in a subprocess forced to it since this
    machine's build may be the VNNI one: products against the dequantized weights for every row
    count a draft step uses; a weight of all -8 against activations of all +127 (unsigned 255),
    the largest int16 pair sums the format allows (2 x 255 x 8); and the whole-forward
    ``Int4Draft`` of that build against the torch layers, and bit for bit against this process's
    build (the tiled kernel's integers are exact and its floats one lane per output in both)."""
    script = """
import sys
import torch
from specdecode.models import draft_quant, kernel_build
from specdecode.models.decoder import Decoder
k = kernel_build.load_int4()
assert k is not None and k.lanes() == 8, k
g = torch.Generator().manual_seed(4)
w = torch.randn(131, 896, generator=g) * 0.05
packed = draft_quant.pack_int4(w)
for n in (1, 2, 3, draft_quant.INT4_MAX_ROWS):
    x = torch.randn(n, 896, generator=g)
    got, want = k.linear_int4(x, packed.packed, packed.scales, packed.offset), x @ packed.dequantize().T
    assert (got - want).norm() <= 0.02 * want.norm(), n
# Every nibble 0 is the value -8; one scale of 1 per group; offset = 128 * sum of the values.
low = torch.zeros(5, 128 // 2, dtype=torch.uint8)
scales, offset = torch.ones(5, 2), torch.full((5,), 128.0 * -8 * 128)
x = torch.ones(3, 128)
torch.testing.assert_close(k.linear_int4(x, low, scales, offset), torch.full((3, 5), -8.0 * 128))
model = Decoder.from_dir(sys.argv[1], role="draft", quantize="int4")
fused, plain = model.new_cache(64), model.new_cache(64)
prompt = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(4))
layered = model.with_backend(model.backend.layered())
model.forward(prompt[:17], fused)  # a prefill: consecutive chunks of the fused forward's rows
for chunk in prompt[:17].split(draft_quant.INT4_MAX_ROWS):
    layered.forward(chunk, plain)
assert model.backend.fused is not None
got = model.forward(prompt[17:], fused)
want = layered.forward(prompt[17:], plain)
assert (got - want).norm() <= 1e-3 * want.norm()
solo = model.new_cache(64)  # every row through Int4Draft
for i in range(0, 20, 8):
    last = model.forward(prompt[i : i + 8], solo)
torch.save(last, sys.argv[2])
"""
    env = {**os.environ, "SPECDECODE_AVX512": "0"}
    saved = tmp_path / "avx2_logits.pt"
    done = subprocess.run([sys.executable, "-c", script, str(tiny_models["qwen2"]), str(saved)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    from specdecode.models.decoder import Decoder

    model = Decoder.from_dir(tiny_models["qwen2"], role="draft", quantize="int4")
    cache = model.new_cache(64)
    prompt = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(4))
    for i in range(0, 20, 8):
        last = model.forward(prompt[i : i + 8], cache)
    assert torch.equal(last, torch.load(saved))


def test_int4_mode_falls_back_to_int8_without_the_kernel(monkeypatch):
    from specdecode.models import draft_quant

    monkeypatch.setattr(kernel_build, "load_int4", lambda: None)
    assert draft_quant.usable_mode("int4", "float32") == "int8"
    assert draft_quant.usable_mode("int8", "float32") == "int8"
    assert draft_quant.usable_mode("int4", "bfloat16") is None


@pytest.mark.parametrize("shape", [(40, 64), (131, 896), (9, 4864)], ids=str)
def test_int4_draft_kernel_matches_its_dequantized_weights(shape):
    """The int4 draft kernel computes the dequantized weights' product up to its per-row int8
    activations (about 1% error), for every row count it serves, and prefill rows take int8."""
    from specdecode.models import draft_quant

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(shape, generator=gen) * 0.05
    packed = draft_quant.pack_int4(w)
    deq = packed.dequantize()
    assert (deq - w).abs().max() <= packed.scales.max() / 2 + 1e-6  # round to nearest step
    for n in (1, 2, 3, draft_quant.INT4_MAX_ROWS):
        x = torch.randn(n, shape[1], generator=gen)
        got, want = draft_quant.linear_draft(x, packed), x @ deq.T
        assert (got - want).norm() <= 0.02 * want.norm(), n
    x = torch.randn(draft_quant.INT4_MAX_ROWS + 1, shape[1], generator=gen)
    assert torch.equal(draft_quant.linear_draft(x, packed), draft_quant.linear_int8_fbgemm(x, packed.int8))


def test_int4_pack_falls_back_to_int8_off_the_group_size():
    from specdecode.models import draft_quant

    w = torch.randn(16, 40)
    assert not isinstance(draft_quant.pack_int4(w), draft_quant.Int4Groups)
    torch.testing.assert_close(draft_quant.linear_draft(torch.ones(1, 40), draft_quant.pack_int4(w)), torch.ones(1, 40) @ w.T,
                               atol=0.1, rtol=0.05)


def _fake_builds(tmp_path, monkeypatch) -> list[list[str]]:
    """Point the kernels folder at ``tmp_path`` and record, for each ``cpp_extension.load``
    call, what its build folder held when it was called."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("SPECDECODE_KERNELS", str(tmp_path))
    calls: list[list[str]] = []

    def fake_load(*, build_directory: str, **_) -> str:
        calls.append(sorted(os.listdir(build_directory)))
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    return calls


def test_a_build_killed_inside_torch_does_not_hang_later_loads(tmp_path, monkeypatch):
    """torch waits without limit while its ``lock`` file exists; a load killed mid-build leaves
    one behind, and the next load must remove it rather than wait for ever."""
    calls = _fake_builds(tmp_path, monkeypatch)
    assert kernel_build._build(kernel_build.SOURCE, "linear_rows", ["-O3"], kernel_build._unavailable) == "module"
    (folder,) = tmp_path.iterdir()
    (folder / "lock").touch()  # what the killed build left
    assert kernel_build._build(kernel_build.SOURCE, "linear_rows", ["-O3"], kernel_build._unavailable) == "module"
    assert "lock" not in calls[-1] and not (folder / "lock").exists()


def test_a_live_build_is_waited_for_not_broken(tmp_path, monkeypatch):
    """While another process holds the folder (its ``lock`` is live), a load waits for it."""
    import fcntl
    import threading

    calls = _fake_builds(tmp_path, monkeypatch)
    kernel_build._build(kernel_build.SOURCE, "linear_rows", ["-O3"], kernel_build._unavailable)
    (folder,) = tmp_path.iterdir()
    with open(folder / ".specdecode.lock", "a+") as other:  # another process, building
        fcntl.flock(other, fcntl.LOCK_EX)
        (folder / "lock").touch()
        waiter = threading.Thread(target=kernel_build._build,
                                  args=(kernel_build.SOURCE, "linear_rows", ["-O3"], kernel_build._unavailable))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and len(calls) == 1 and (folder / "lock").exists()
        (folder / "lock").unlink()  # the other build ends
        fcntl.flock(other, fcntl.LOCK_UN)
    waiter.join(10)
    assert not waiter.is_alive() and len(calls) == 2
