"""The int4 draft's native whole forward (``Int4Draft``) computes what the torch layers compute.

Both paths use the same int4 weights and the same per-row int8 activations, so they differ only
where a rounding of the norm or attention moves an activation across an int8 step, which on
the tiny models here leaves relative errors near 1e-7. Greedy identity with an int4 draft is checked with the
other drafters (test_draft_options.py); this checks that the draft itself is right, which is what
its acceptance rate depends on.
"""

from __future__ import annotations

import pytest
import torch

from specdecode.models import draft_heads, draft_quant, kernel_build
from specdecode.models.int4_forward import fused_int4_draft
from specdecode.models.int8_rows import Int8Rows
from specdecode.models.decoder import Decoder
from specdecode.models.weights import DecoderWeights
from tests.conftest import make_tiny_model


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-3) -> bool:
    # Measured here: relative errors near 1e-7; a wrong position or head gives tens of percent.
    return bool((got - want).norm() <= tol * want.norm())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fused_forward_matches_the_torch_layers(tiny_models, arch):
    model = Decoder.from_dir(tiny_models[arch], role="draft", quantize="int4")
    assert model.backend.fused is not None
    layered = model.with_backend(model.backend.layered())  # the same weights through the torch layers
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1))
    fused, plain = model.new_cache(64), model.new_cache(64)
    # A prefill longer than the fused forward's rows runs as consecutive chunks of them.
    got = model.forward(prompt[:30], fused)
    want = torch.cat([layered.forward(chunk, plain) for chunk in prompt[:30].split(draft_quant.INT4_MAX_ROWS)])
    assert got.shape == want.shape == (30, 96) and _close(got, want)
    assert _close(fused.k[:, :, :30], plain.k[:, :, :30]) and _close(fused.v[:, :, :30], plain.v[:, :, :30])
    offset = 30
    for n in (1, 3, draft_quant.INT4_MAX_ROWS):
        rows = prompt[offset - n : offset] if n > 1 else prompt[offset : offset + 1]
        got = model.forward(rows, fused)
        want = layered.forward(rows, plain)
        assert got.shape == want.shape == (n, 96)
        assert _close(got, want), n
        assert fused.length == plain.length
        assert _close(fused.k[:, :, : fused.length], plain.k[:, :, : plain.length])
        assert _close(fused.v[:, :, : fused.length], plain.v[:, :, : plain.length])
    last = model.forward(prompt[:2], fused, last_only=True)
    want = layered.forward(prompt[:2], plain, last_only=True)
    assert last.shape == (1, 96) and _close(last, want)


def test_a_long_input_has_the_bits_of_short_calls(tiny_models):
    """A prefill runs as calls of up to FUSED_MAX_ROWS rows, the calls before the last without
    logits; a row's bits depend on neither, so the last row's logits and every key and value equal
    those of feeding the same tokens a few rows a call."""
    model = Decoder.from_dir(tiny_models["qwen2"], role="draft", quantize="int4")
    n = draft_quant.FUSED_MAX_ROWS + 9
    prompt = torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(2))
    long, short = model.new_cache(n + 8), model.new_cache(n + 8)
    got = model.forward(prompt, long, last_only=True)
    want = [model.forward(chunk, short) for chunk in prompt.split(3)][-1][-1:]
    assert got.shape == (1, 96) and torch.equal(got, want)
    assert long.length == short.length == n
    assert torch.equal(long.k[:, :, :n], short.k[:, :, :n]) and torch.equal(long.v[:, :, :n], short.v[:, :, :n])
    empty = model.backend.fused.forward(prompt[:4], long.k, long.v, 0, True, False)  # no head asked
    assert empty.shape == (0, 96)


def test_a_batch_of_sequences_has_the_bits_of_each_alone(tiny_models):
    """Several requests' draft steps run as one native forward (each sequence's rows against its
    own cache); every row's logits, keys and values have the bits of that sequence's forward alone,
    and a batch above ``fused_batch_rows`` rows in all takes the torch layers."""
    model = Decoder.from_dir(tiny_models["qwen2"], role="draft", quantize="int4")
    fused = model.backend.fused
    calls = []
    original = fused.forward_batch
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 12, 3)]
    alone, batched = [model.new_cache(48) for _ in prompts], [model.new_cache(48) for _ in prompts]
    for p, a, b in zip(prompts, alone, batched):
        model.forward(p, a), model.forward(p, b)

    class Spy:  # the native call, counted (pybind methods cannot be patched on the instance)
        def __getattr__(self, name):
            return getattr(fused, name)

        def forward_batch(self, *args):
            calls.append(sum(args[4]))
            return original(*args)

    model.backend.fused = Spy()
    steps = [torch.tensor([5]), torch.tensor([9, 4]), torch.tensor([1])]
    for last_only in (True, False):
        got = model.forward_batch(list(zip(steps, batched)), last_only=last_only)
        want = [model.forward(t, c, last_only=last_only) for t, c in zip(steps, alone)]
        assert [g.shape for g in got] == [w.shape for w in want]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    for a, b in zip(alone, batched):
        assert a.length == b.length and torch.equal(a.k[:, :, : a.length], b.k[:, :, : b.length])
        assert torch.equal(a.v[:, :, : a.length], b.v[:, :, : b.length])
    assert calls == [4, 4]
    count = model.backend.fused_batch_rows // draft_quant.INT4_MAX_ROWS + 1  # rows of the int4 layers each
    big = [torch.randint(0, 96, (draft_quant.INT4_MAX_ROWS,), generator=torch.Generator().manual_seed(i)) for i in range(count)]
    got = model.forward_batch([(t, model.new_cache(48)) for t in big])
    assert calls == [4, 4]  # too many rows for one native call: the torch layers (int8 at that many rows)
    assert [g.shape for g in got] == [(draft_quant.INT4_MAX_ROWS, 96)] * count and all(bool(g.isfinite().all()) for g in got)


def test_fused_forward_only_for_an_all_int4_draft(tiny_models, tmp_path):
    assert Decoder.from_dir(tiny_models["qwen2"], role="draft", quantize="int8").backend.fused is None
    assert Decoder.from_dir(tiny_models["qwen2"], role="draft").backend.fused is None
    # An MLP width off the 64-input groups packs ``down`` int8, so the model keeps the torch layers.
    odd = make_tiny_model(tmp_path / "odd", "qwen2", intermediate_size=96)
    model = Decoder.from_dir(odd, role="draft", quantize="int4")
    assert model.backend.fused is None and not isinstance(model.layers[0].down, draft_quant.Int4Groups)
    cache = model.new_cache(16)
    assert model.forward(torch.tensor([1, 2, 3]), cache).shape == (3, 96)


def test_fused_forward_rejects_bad_tokens_and_full_caches(tiny_models):
    model = Decoder.from_dir(tiny_models["llama"], role="draft", quantize="int4")
    cache = model.new_cache(8)
    with pytest.raises(RuntimeError, match="token id"):
        model.backend.fused.forward(torch.tensor([96]), cache.k, cache.v, 0, False)
    with pytest.raises(RuntimeError, match="past the cache"):
        model.backend.fused.forward(torch.tensor([1, 2]), cache.k, cache.v, cache.capacity - 1, False)


def test_draft_copy_packs_every_linear_once_and_stays_close():
    """A trained head's drafting form: every nn.Linear packed (4-bit for a few rows, the int8 copy
    for many), made once per head object, close to the float head on both paths."""
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.SiLU(), torch.nn.Linear(64, 32, bias=False))
    copy = draft_heads.draft_copy(head)
    assert draft_heads.draft_copy(head) is copy  # shared by every drafter of this head
    assert not any(isinstance(m, torch.nn.Linear) for m in copy.modules())
    assert all(isinstance(m, torch.nn.Linear) for m in (head[0], head[2]))  # the training form is untouched
    # Measured: 6.5% relative error with 4-bit weights, 2% on the int8 copy; a missing bias or a
    # wrong layout gives about 100%.
    for rows, tol in ((1, 0.1), (draft_quant.INT4_MAX_ROWS + 5, 0.04)):
        x = torch.randn(rows, 128)
        with torch.no_grad():
            assert _close(copy(x), head(x), tol=tol)


def test_an_int4_draft_from_float_weights_prefills_with_float_activations(tiny_models):
    """Many-row calls take per-row int8 weights with float activations: a prompt row with an
    outlier does not blur its neighbours, as one activation scale per call would."""
    model = Decoder.from_dir(tiny_models["qwen2"], role="draft", quantize="int4")
    w = model.layers[0].qkv
    assert isinstance(w, draft_quant.Int4Groups) and isinstance(w.int8, Int8Rows)
    x = torch.randn(16, w.packed.shape[1] * 2)
    x[0] *= 1000.0  # an outlier row
    want = x[1:] @ w.int8.dequantize().T
    assert _close(draft_quant.linear_draft(x, w)[1:], want, tol=1e-4)


@pytest.mark.parametrize("shape", [(37, 128), (131, 896), (16, 4864)], ids=str)
def test_tiled_layout_holds_every_weight(shape):
    """``Int4Draft``'s tiles (``linear_int4_tiled`` runs one matrix through them) hold each weight
    where the kernel reads it: 127 times the one-hot row k gives 127 times column k of the
    dequantized weight exactly (exact int32 sums; an fp16 scale times an integer below 2^10 is
    exact in float32), for every column and an output count off the 16-output tiles. Random rows
    (1 to 8) agree with the dequantized product and with the row-major kernel."""
    kernel = kernel_build.load_int4()
    gen = torch.Generator().manual_seed(5)
    w = draft_quant.pack_int4(torch.randn(shape, generator=gen) * 0.05)
    assert torch.equal(w.scales, w.scales.half().float())  # fp16 values: the tiles lose nothing
    deq = w.dequantize()
    eye = 127.0 * torch.eye(shape[1])
    for k in range(0, shape[1], 8):
        got = kernel.linear_int4_tiled(eye[k : k + 8].contiguous(), w.packed, w.scales, w.offset)
        assert torch.equal(got, 127.0 * deq[:, k : k + 8].T), k
        for rows in (1, 2, 3, 5):  # passes of up to MAXR rows (4 on AVX2, 8 on VNNI) and the rest
            got = kernel.linear_int4_tiled(eye[k : k + rows].contiguous(), w.packed, w.scales, w.offset)
            assert torch.equal(got, 127.0 * deq[:, k : k + rows].T), (k, rows)
    for n in range(1, draft_quant.INT4_MAX_ROWS + 1):
        x = torch.randn(n, shape[1], generator=gen)
        got = kernel.linear_int4_tiled(x, w.packed, w.scales, w.offset)
        # Measured: about 1% from the int8 activations; the same integers as the row-major kernel,
        # so only float rounding (about 1e-7) apart from it.
        assert _close(got, x @ deq.T, tol=0.02), n
        assert _close(got, kernel.linear_int4(x, w.packed, w.scales, w.offset), tol=1e-5), n
        # A row's bits do not depend on the rows beside it, whichever pass computes it.
        assert torch.equal(got[:1], kernel.linear_int4_tiled(x[:1].contiguous(), w.packed, w.scales, w.offset)), n
        assert torch.equal(got[-2:], kernel.linear_int4_tiled(x[-2:].contiguous(), w.packed, w.scales, w.offset)), n


def _weights(model: Decoder, lm_head) -> DecoderWeights:
    return DecoderWeights(torch.float32, model.embed, lm_head, model.norm, model.layers, model.cos, model.sin)


def test_fused_forward_with_some_lm_head_rows_gives_their_logits(tiny_models):
    """A draft head over a vocabulary subset (rows of the LM head's ``Int4Groups``, a count off the
    16-output tiles) gives exactly those rows' logits: each output is computed alone."""
    model = Decoder.from_dir(tiny_models["qwen2"], role="draft", quantize="int4")
    head = model.lm_head
    rows = torch.arange(0, 96, 5)  # 20 rows
    sub = draft_quant.Int4Groups(head.packed[rows], head.scales[rows], head.offset[rows], head.int8, head.kernel)
    fused = fused_int4_draft(model.config, _weights(model, sub))
    prompt = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(2))
    full_cache, sub_cache = model.new_cache(32), model.new_cache(32)
    for start, stop in ((0, 8), (8, 11)):
        want = model.forward(prompt[start:stop], full_cache)
        got = fused.forward(prompt[start:stop], sub_cache.k, sub_cache.v, start, False)
        assert got.shape == (stop - start, 20)
        assert torch.equal(got, want[:, rows])


def test_fused_forward_bits_do_not_depend_on_the_thread_count(tiny_models):
    model = Decoder.from_dir(tiny_models["llama"], role="draft", quantize="int4")
    prompt = torch.randint(0, 96, (13,), generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    out = {}
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            cache = model.new_cache(32)
            out[count] = [model.forward(prompt[i : i + 5], cache) for i in range(0, 13, 5)]
    finally:
        torch.set_num_threads(threads)
    for count in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(out[1], out[count])), count


def test_an_int4_draft_from_a_gguf_is_packed_once_then_mapped(tmp_path, monkeypatch, caplog):
    """The int4 pack of a GGUF draft is cached beside its planes: the same weights as packing
    afresh, no packing at the next load, and a damaged cache packed again."""
    from specdecode.models.gguf_convert import convert_gguf
    from specdecode.models.gguf_planes import GGUFLinear
    from tests.gguf_blocks import write_model_gguf

    monkeypatch.setenv("SPECDECODE_HOME", str(tmp_path / "home"))
    write_model_gguf(tmp_path / "d.gguf", {}, hidden=64, inter=96, layers=2)  # 96 inputs: not whole int4 groups
    folder = convert_gguf(tmp_path / "d.gguf", tmp_path / "d", progress=False)
    ids = torch.tensor([3, 14, 15, 92, 65])

    def load() -> tuple[Decoder, torch.Tensor]:
        model = Decoder.from_dir(folder, role="draft", quantize="int4")
        return model, model.forward(ids, model.new_cache(16))

    first, want = load()
    [cache] = (tmp_path / "home" / "native").glob("*.int4-v*.safetensors")
    for w in (first.lm_head, first.layers[0].qkv, first.layers[1].gate_up):
        fresh = draft_quant.pack_int4(w.int8.dequantize())
        assert isinstance(w.int8, GGUFLinear)  # calls of many rows run the GGUF weight as shipped
        assert all(torch.equal(getattr(w, p), getattr(fresh, p)) for p in ("packed", "scales", "offset"))
    assert isinstance(first.layers[0].down, GGUFLinear)

    def refuse(*args, **kwargs):
        raise AssertionError("packed again")

    with monkeypatch.context() as patch:
        patch.setattr(draft_quant, "pack_int4", refuse)
        again, got = load()
    assert torch.equal(got, want)

    cache.write_bytes(cache.read_bytes()[:-100])  # a crash or a full disk: repacked, not read
    with caplog.at_level("WARNING"):
        _, repacked = load()
    assert torch.equal(repacked, want) and "int4 draft cache" in caplog.text
