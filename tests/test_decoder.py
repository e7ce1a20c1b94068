"""The decoder matches HF transformers, and a row's logits never depend on its companions."""

from __future__ import annotations

import pytest
import torch

from specdecode.models.decoder import Decoder, HiddenCapture


@pytest.mark.parametrize("native,role", [(None, "target"), (False, "target"), (None, "draft")],
                         ids=["native", "portable", "draft-fast-path"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_logits_match_transformers(tiny_models, arch, native, role):
    from transformers import AutoModelForCausalLM

    path = tiny_models[arch]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = Decoder.from_dir(path, native=native, role=role)
    tokens = torch.randint(0, ours.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(tokens[None]).logits[0]
    cache = ours.new_cache(64)
    # prefill, then single steps, then a multi-token chunk: all must agree with the full forward
    got = torch.cat([ours.forward(tokens[:20], cache), ours.forward(tokens[20:21], cache),
                     ours.forward(tokens[21:], cache)])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("native", [None, False], ids=["native", "portable"])
def test_captured_hidden_states_are_transformers_hidden_states(tiny_models, native):
    """A capture of layers (0, 1, L) holds HF's hidden_states[0] and [1] and the last layer's
    output before the final norm, for every row of chunked forwards, a ``last_only`` one included;
    the logits are the bits of a forward without a capture."""
    from transformers import AutoModelForCausalLM

    path = tiny_models["qwen2"]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = Decoder.from_dir(path, native=native)
    d = ours.config.hidden_size
    tokens = torch.randint(0, ours.config.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = ref(tokens[None], output_hidden_states=True)
    capture = HiddenCapture((0, 1, ours.config.num_layers))
    cache, plain = ours.new_cache(64), ours.new_cache(64)
    ours.forward(tokens[:17], cache, last_only=True, capture=capture)
    logits = ours.forward(tokens[17:], cache, capture=capture)
    ours.forward(tokens[:17], plain)
    assert torch.equal(logits, ours.forward(tokens[17:], plain))
    states = capture.take()
    assert states.shape == (30, 3 * d)
    torch.testing.assert_close(states[:, :d], out.hidden_states[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[:, d : 2 * d], out.hidden_states[1][0], atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # HF's last entry is after the final norm
        torch.testing.assert_close(ref.model.norm(states[:, 2 * d :]), out.hidden_states[-1][0], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        capture.take()  # taken: nothing left


@pytest.mark.parametrize("native", [None, False], ids=["native", "portable"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rows_are_batch_invariant(tiny_models, arch, native):
    """Decoding one token at a time gives bit-identical logits to chunks of 2..9 tokens."""
    model = Decoder.from_dir(tiny_models[arch], native=native)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, model.config.vocab_size, (300,), generator=gen)
    prefix = 140  # crosses an attention key block (128) during the chunks
    one = model.new_cache(400)
    model.forward(tokens[:prefix], one)
    singles = torch.cat([model.forward(tokens[i : i + 1], one) for i in range(prefix, 300)])
    chunked = model.new_cache(400)
    model.forward(tokens[:prefix], chunked)
    rows, i = [], prefix
    sizes = torch.randint(2, 10, (200,), generator=gen).tolist()
    while i < 300:
        n = min(sizes.pop(), 300 - i)
        rows.append(model.forward(tokens[i : i + n], chunked))
        i += n
    assert torch.equal(torch.cat(rows), singles)


@pytest.mark.parametrize("native", [None, False], ids=["native", "portable"])
def test_batched_sequences_get_their_solo_bits(tiny_models, native):
    """forward_batch over sequences with different cache lengths and row counts (over 64 rows in
    all, beyond one kernel pass) gives each the logits it gets alone, and the same cache state."""
    model = Decoder.from_dir(tiny_models["qwen2"], native=native)
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in (5, 130, 40, 70, 9)]
    steps = [[torch.randint(0, vocab, (n,), generator=gen) for n in sizes]
             for sizes in ((1, 6, 33, 17, 2), (9, 1, 1, 30, 33))]
    solo_caches = [model.new_cache(300) for _ in prompts]
    batch_caches = [model.new_cache(300) for _ in prompts]
    for p, a, b in zip(prompts, solo_caches, batch_caches):
        model.forward(p, a)
        model.forward(p, b)
    for step in steps:
        solo = [model.forward(t, c) for t, c in zip(step, solo_caches)]
        batched = model.forward_batch(list(zip(step, batch_caches)))
        for a, b in zip(solo, batched):
            assert torch.equal(a, b)
    assert [c.length for c in batch_caches] == [c.length for c in solo_caches]
    last = model.forward_batch([(torch.tensor([1, 2]), batch_caches[0]), (torch.tensor([3]), batch_caches[1])],
                               last_only=True)
    assert torch.equal(last[0], model.forward(torch.tensor([1, 2]), solo_caches[0])[-1:])
    assert torch.equal(last[1], model.forward(torch.tensor([3]), solo_caches[1]))


def test_cache_rollback_reproduces_logits(tiny_models):
    model = Decoder.from_dir(tiny_models["llama"])
    tokens = torch.arange(10) % model.config.vocab_size
    cache = model.new_cache(32)
    model.forward(tokens[:6], cache)
    first = model.forward(tokens[6:9], cache)
    cache.trim(3)
    model.forward(torch.tensor([5, 7]), cache)  # a wrong continuation overwrites the slots ...
    cache.trim(2)
    again = model.forward(tokens[6:9], cache)  # ... and is forgotten after trim
    assert torch.equal(first, again)
    assert cache.length == 9


def test_context_overflow_raises_named_error(tiny_models):
    from specdecode.errors import PromptTooLongError

    model = Decoder.from_dir(tiny_models["qwen2"])
    cache = model.new_cache(8)
    with pytest.raises(PromptTooLongError):
        model.forward(torch.zeros(cache.capacity + 1, dtype=torch.long), cache)


def test_bfloat16_logits_close_to_transformers(tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models["qwen2"]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours = Decoder.from_dir(path, dtype="bfloat16")
    tokens = torch.arange(20) % ours.config.vocab_size
    with torch.no_grad():
        expected = ref(tokens[None]).logits[0].float()
    got = ours.forward(tokens, ours.new_cache(32))
    assert got.dtype == torch.float32
    # bf16 keeps ~3 significant digits; the logits here are O(10).
    torch.testing.assert_close(got, expected, atol=0.25, rtol=0.05)


@pytest.mark.parametrize("native", [None, False], ids=["native", "portable"])
def test_last_only_keeps_the_last_rows_bits_through_a_pruned_last_layer(tiny_models, native):
    """With ``last_only``, the last layer's o projection and MLP run for each segment's last row
    alone (on calls that keep a row's bits): its logits equal the whole call's at that row, for
    chains, a token tree and a batch of both, and every key and value is still written."""
    model = Decoder.from_dir(tiny_models["qwen2"], native=native)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in (12, 20)]
    tree = [-1, 0, 0, 2, 3]  # two branches from the root: rows 0-1 and 0-2-3-4

    def prefilled():
        caches = [model.new_cache(64) for _ in prompts]
        for p, c in zip(prompts, caches):
            model.forward(p, c)
        return caches

    steps = [torch.randint(0, vocab, (n,), generator=gen) for n in (3, 5)]
    pruned, whole = prefilled(), prefilled()
    got = model.forward_batch(list(zip(steps, pruned)), last_only=True, trees=[None, tree])
    want = model.forward_batch(list(zip(steps, whole)), trees=[None, tree])
    assert [g.shape[0] for g in got] == [1, 1]
    assert torch.equal(got[0], want[0][-1:]) and torch.equal(got[1], want[1][-1:])
    assert [c.length for c in pruned] == [c.length for c in whole]
    assert torch.equal(pruned[0].k[:, :, : pruned[0].length], whole[0].k[:, :, : whole[0].length])
    assert torch.equal(pruned[1].node_k, whole[1].node_k)  # a tree's keys wait in its side buffers
    alone, reference = prefilled()[0], prefilled()[0]
    last = model.forward(steps[0], alone, last_only=True, invariant=True)  # one segment, on the invariant path
    assert torch.equal(last, model.forward(steps[0], reference, invariant=True)[-1:])
    assert torch.equal(alone.v[:, :, : alone.length], reference.v[:, :, : reference.length])
