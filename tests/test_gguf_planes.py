"""GGUF weights run as shipped: the repack is lossless, the kernel matches the dequantized
reference within activation-quantization error, every row's bits are independent of the other
rows of a call, every build the CPU runs (portable, AVX2, VNNI) agrees bit for bit, and a tiny
native model keeps every method token-identical to plain decoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.errors import UnsupportedModelError
from specdecode.models import gguf_planes, kernel_build
from tests.gguf_blocks import F16_FIELDS, NATIVE, dequantized, random_blocks, write_model_gguf
from tests.methods import SPEC_METHODS, tiny_heads

# Activations are quantized to int8 per block of 32 or 256 (scale = max / 127), so a dot product
# of n terms carries a relative error of about 1 / (127 * sqrt(3)) per term: ~0.5% of the result's
# norm for Gaussian inputs. 2% leaves room for every type without hiding a decoding error (a wrong
# nibble or scale gives errors of order 100%).
REL_TOL = 0.02


def _weight(type_name: str, out: int, inp: int, seed: int = 0) -> tuple[gguf_planes.GGUFWeight, np.ndarray, np.ndarray]:
    raw = random_blocks(np.random.default_rng(seed), type_name, out, inp)
    planes = {k: torch.from_numpy(v) for k, v in gguf_planes.repack(raw, type_name, out, inp).items()}
    return gguf_planes.weight_from_planes(type_name, out, inp, planes), raw, dequantized(raw, type_name, out, inp)


def _builds() -> list[object]:
    """Every build of the GGUF kernel this CPU runs: portable, AVX2, and VNNI where it has it."""
    return [kernel_build.load_gguf(isa) for isa in kernel_build.gguf_isas()]


@pytest.mark.parametrize("type_name", NATIVE)
def test_repack_is_lossless(type_name: str) -> None:
    w, _, ref = _weight(type_name, 24, 512)
    assert torch.equal(w.dequantize(), torch.from_numpy(ref))
    ids = torch.tensor([5, 0, 23, 5])
    assert torch.equal(w.rows(ids), torch.from_numpy(ref)[ids])


@pytest.mark.parametrize("type_name", NATIVE)
def test_kernel_matches_dequantized_reference(type_name: str) -> None:
    w, _, ref = _weight(type_name, 40, 768, seed=1)
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(0))
    want = x @ torch.from_numpy(ref).T
    for build in _builds():
        got = build.linear_gguf(x, [w.part])
        assert (got - want).norm() / want.norm() < REL_TOL, (type_name, build.isa())


@pytest.mark.parametrize("type_name", NATIVE)
def test_rows_bitwise_invariant_and_builds_agree(type_name: str) -> None:
    w, _, _ = _weight(type_name, 37, 512, seed=2)  # 37 outputs: uneven thread split
    x = torch.randn(24, 512, generator=torch.Generator().manual_seed(1)) * 3
    results = []
    for build in _builds():
        alone = torch.cat([build.linear_gguf(x[i : i + 1].contiguous(), [w.part]) for i in range(24)])
        for n in range(1, 25):  # one tile up to 15 rows; from 16, tiles of 8 rows (wide: by 4 outputs) and one of the rest
            for start in range(25 - n):  # every offset: rows land in every tile position
                got = build.linear_gguf(x[start : start + n].contiguous(), [w.part])
                assert torch.equal(got, alone[start : start + n]), (type_name, build.isa(), n, start)
        results.append(alone)
    assert all(torch.equal(results[0], r) for r in results[1:]), "the builds differ"


def test_multi_part_call_equals_separate_calls() -> None:
    parts = [_weight(t, out, 512, seed=i)[0] for i, (t, out) in enumerate([("Q4_K", 64), ("Q4_K", 16), ("Q6_K", 16)])]
    x = torch.randn(3, 512)
    kernel = kernel_build.load_gguf()
    fused = kernel.linear_gguf(x, [p.part for p in parts])
    assert torch.equal(fused, torch.cat([kernel.linear_gguf(x, [p.part]) for p in parts], dim=1))


@pytest.mark.parametrize("pre", ["rms", "glu"])
def test_fused_input_transforms_and_residual(pre: str) -> None:
    """RMS norm or silu(gate) * up fused before the product equals doing them first (up to the
    kernel's own rounding of the transform), a residual is added exactly, and rows stay
    bitwise invariant in every build."""
    w, _, _ = _weight("Q4_K", 24, 512, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 1024 if pre == "glu" else 512, generator=g) * 3
    norm = torch.rand(512, generator=g) + 0.5
    residual = torch.randn(9, 24, generator=g)
    code, kwargs = (1, dict(norm=norm, eps=1e-6)) if pre == "rms" else (2, {})
    if pre == "rms":
        first = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
    else:
        first = torch.nn.functional.silu(x[:, :512]) * x[:, 512:]
    results = []
    for build in _builds():
        plain = build.linear_gguf(first.contiguous(), [w.part])
        fused = build.linear_gguf(x, [w.part], code, kwargs.get("norm"), kwargs.get("eps", 0.0))
        assert (fused - plain).norm() / plain.norm() < REL_TOL, (pre, build.isa())
        added = build.linear_gguf(x, [w.part], code, kwargs.get("norm"), kwargs.get("eps", 0.0), residual)
        assert torch.equal(added, residual + fused)
        alone = torch.cat([build.linear_gguf(x[i : i + 1].contiguous(), [w.part], code, kwargs.get("norm"),
                                             kwargs.get("eps", 0.0)) for i in range(9)])
        assert torch.equal(fused, alone)
        results.append(fused)
    assert all(torch.equal(results[0], r) for r in results[1:]), "the builds differ"


def test_the_default_build_is_the_fastest_this_cpu_runs(monkeypatch) -> None:
    monkeypatch.delenv("SPECDECODE_AVX512", raising=False)
    monkeypatch.delenv("SPECDECODE_GGUF_ISA", raising=False)
    monkeypatch.delenv("SPECDECODE_GGUF_PORTABLE", raising=False)
    cpu = kernel_build._cpu_flags()
    if kernel_build.cpu_has_avx2_fma() and ({"avx512f", "avx512vl", "avx512_vnni"} <= cpu or "avx_vnni" in cpu):
        assert kernel_build.gguf_isas()[-1] == "vnni"
    assert kernel_build.load_gguf().isa() == kernel_build.gguf_isa() == kernel_build.gguf_isas()[-1]
    monkeypatch.setenv("SPECDECODE_GGUF_ISA", "portable")
    assert kernel_build.gguf_isa() == "portable"
    monkeypatch.setenv("SPECDECODE_GGUF_ISA", "avx9")
    with pytest.raises(UnsupportedModelError, match="SPECDECODE_GGUF_ISA=avx9 is not a GGUF kernel build"):
        kernel_build.gguf_isa()
    with pytest.raises(ValueError, match="unknown GGUF kernel build 'avx9'"):
        kernel_build.gguf_flags("avx9")


def test_a_failed_default_vnni_build_falls_back_to_avx2(monkeypatch, caplog) -> None:
    """The VNNI build needs a recent compiler (``-mavxvnni``: GCC 11); where it fails, models run
    on the AVX2 build (same bits) unless the VNNI build was asked for by name."""
    calls = []

    def load(isa=None):  # noqa: ANN001, ANN202 - stands in for the cached loader
        calls.append(isa)
        if isa == "vnni":
            raise UnsupportedModelError("the native GGUF kernel is unavailable: building it failed")
        return f"{isa} build"

    unwrapped = kernel_build.load_gguf.__wrapped__
    monkeypatch.setattr(kernel_build, "load_gguf", load)
    monkeypatch.setattr(kernel_build, "gguf_isa", lambda: "vnni")
    monkeypatch.delenv("SPECDECODE_GGUF_ISA", raising=False)
    assert unwrapped() == "avx2 build" and calls == ["vnni", "avx2"]
    assert "VNNI build failed, using its AVX2 build" in caplog.text
    monkeypatch.setenv("SPECDECODE_GGUF_ISA", "vnni")
    with pytest.raises(UnsupportedModelError):
        unwrapped()


# Value bytes at the integer extremes: 0xFF (the largest unsigned values; Q6_K values 63 and its
# scales -1), 0x80 (Q8_0's -128, Q6_K's scale -128), and Q6_K's values 63 under scales -128.
EXTREME_FILLS = [("all 0xFF", lambda size: [0xFF] * size), ("all 0x80", lambda size: [0x80] * size),
                 ("Q6_K 63 at scale -128", lambda size: [0xFF] * 192 + [0x80] * (size - 192))]


@pytest.mark.parametrize("type_name", NATIVE)
def test_extreme_blocks_and_activations_agree_across_builds(type_name: str) -> None:
    """The builds' integer steps agree where saturation could part them: largest weights against
    activations quantized to +-127 (rows of +-1, alternating, and one spike per block)."""
    block, size = next((b, s) for n, b, s in gguf_planes.TYPES.values() if n == type_name)
    raw = random_blocks(np.random.default_rng(3), type_name, 8, 512)
    x = torch.ones(4, 512)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3, ::block] = -50.0  # the rest of each block quantizes to -3 or so
    x = x.repeat(5, 1)  # 20 rows: the wide tiles of 16 rows and more too
    for label, fill in EXTREME_FILLS:
        if label.startswith("Q6_K") and type_name != "Q6_K":
            continue
        blocks = raw.reshape(8, 512 // block, size).copy()
        bytes_ = np.array(fill(size), dtype=np.uint8)
        keep = np.zeros(size, dtype=bool)  # the fp16 scales stay finite
        for off in F16_FIELDS[type_name]:
            keep[off : off + 2] = True
        blocks[..., ~keep] = bytes_[~keep]
        planes = {k: torch.from_numpy(v) for k, v in gguf_planes.repack(blocks.reshape(8, -1), type_name, 8, 512).items()}
        w = gguf_planes.weight_from_planes(type_name, 8, 512, planes)
        ref = torch.from_numpy(dequantized(blocks.reshape(8, -1), type_name, 8, 512))
        results = [build.linear_gguf(x, [w.part]) for build in _builds()]
        assert all(torch.equal(results[0], r) for r in results[1:]), (type_name, label)
        want = x[1:2] @ ref.T  # every activation -1: exact in int8, so only weight rounding is left
        assert (results[0][1:2] - want).norm() <= 1e-4 * want.norm() + 1e-6, (type_name, label)


def test_extreme_activations_and_zero_rows() -> None:
    w, _, ref = _weight("Q6_K", 8, 256)
    x = torch.zeros(3, 256)
    x[1] = 1e30
    x[2, ::2] = -1e-30
    y = kernel_build.load_gguf().linear_gguf(x, [w.part])
    assert torch.equal(y[0], torch.zeros(8)) and torch.isfinite(y).all()
    want = x[1].double() @ torch.from_numpy(ref).T.double()
    assert ((y[1].double() - want).norm() / want.norm()) < REL_TOL


def test_unsupported_type_names_tensor_and_fallback() -> None:
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_up\.weight.*Q2_K.*--quantize none"):
        gguf_planes.check_type("blk.0.ffn_up.weight", "Q2_K", 256)
    with pytest.raises(UnsupportedModelError, match="not whole Q4_K blocks"):
        gguf_planes.check_type("blk.0.ffn_up.weight", "Q4_K", 896)


def test_truncated_gguf_is_a_named_error(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_model_gguf(path, {"": "Q8_0"}, hidden=64, inter=64, layers=1)
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(UnsupportedModelError):
        LLM(model=str(bad), progress=False)


# ---- a tiny model run natively: every method equals plain decoding of the native target ------

MIXED = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q4_0", "ffn_gate": "Q5_0",
         "ffn_up": "Q4_1", "ffn_down": "Q5_1", "token_embd": "Q8_0", "output.weight": "Q6_K"}


@pytest.fixture(scope="module")
def native_llm(tmp_path_factory) -> LLM:
    root = tmp_path_factory.mktemp("native")
    write_model_gguf(root / "target.gguf", MIXED, seed=3)
    write_model_gguf(root / "draft.gguf", {"": "Q8_0"}, seed=3)
    heads = tiny_heads(LLM(model=str(root / "target.gguf"), max_seq_len=64, progress=False), root / "heads")
    return LLM(model=str(root / "target.gguf"), draft=str(root / "draft.gguf"), max_seq_len=512, progress=False,
               **heads)


def test_native_is_the_default_for_gguf_sources(native_llm: LLM) -> None:
    assert native_llm.quantize == "native"
    assert all(isinstance(w, gguf_planes.GGUFLinear) for w in (native_llm.target.layers[0].qkv, native_llm.target.lm_head))


def test_native_model_matches_its_dequantized_weights(native_llm: LLM) -> None:
    """One forward of the native target against the same weights dequantized, in float."""
    ids = torch.tensor(native_llm.tokenizer.encode("def f(x): return x + 1"))
    target = native_llm.target
    cache = target.new_cache(64)
    got = target.forward(ids, cache)
    reference = LLM(model=str(native_llm.model_dir), quantize="none", max_seq_len=512, progress=False).target
    want = reference.forward(ids, reference.new_cache(64))
    assert ((got - want).norm() / want.norm()) < 0.05


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_native_greedy_identity(native_llm: LLM, method: str) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    drafted = 0
    for prompt in ("def f(x): return x + 1\ndef f(x):", "class A:\n    def __init__(self): self.a = 1\n    def"):
        plain = native_llm.generate(prompt, params, method="none")[0]
        spec = native_llm.generate(prompt, params, method=method, num_speculative_tokens=4, adaptive=False)[0]
        assert spec.token_ids == plain.token_ids, method
        drafted += spec.stats.draft_tokens
    assert drafted > 0


def test_native_prefill_equals_token_by_token(native_llm: LLM) -> None:
    target = native_llm.target
    ids = torch.tensor(native_llm.tokenizer.encode("x = [i * i for i in range(10)] # squares " * 3))
    whole = target.forward(ids, target.new_cache(256))
    cache = target.new_cache(256)
    steps = torch.cat([target.forward(ids[i : i + 1], cache) for i in range(len(ids))])
    assert torch.equal(whole, steps)


def test_f16_gguf_defaults_to_float_and_native_is_refused_by_name(tmp_path: Path, caplog) -> None:
    from tests.test_gguf_convert import write_tiny_gguf

    path = tmp_path / "f16.gguf"
    write_tiny_gguf(path, "qwen2")  # F16 matrices: no native kernel
    llm = LLM(model=str(path), max_seq_len=128, progress=False)
    assert llm.quantize is None and "dequantized to float32" in caplog.text
    with pytest.raises(UnsupportedModelError, match=r"token_embd\.weight is F16.*--quantize none"):
        LLM(model=str(path), max_seq_len=128, progress=False, quantize="native")


@pytest.mark.parametrize("method", ["draft_model", "tree"])
def test_native_sampling_follows_the_exact_target_distribution(tmp_path: Path, method: str) -> None:
    """The shared sampling-law test on a natively quantized pair: chain and tree verification."""
    from tests.test_sampling_lossless import _prompt_with_likely_continuations, assert_sampled_joint_is_exact

    write_model_gguf(tmp_path / "target.gguf", MIXED, seed=3, output_scale=0.003)
    write_model_gguf(tmp_path / "draft.gguf", {"": "Q8_0"}, seed=4, output_scale=0.003)
    llm = LLM(model=str(tmp_path / "target.gguf"), draft=str(tmp_path / "draft.gguf"), max_seq_len=300,
              progress=False)
    ids = _prompt_with_likely_continuations(llm, SamplingParams(max_tokens=3, temperature=1.0, top_k=3))
    assert_sampled_joint_is_exact(llm, ids, lambda: llm.new_drafter(method))
