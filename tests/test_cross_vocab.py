"""Cross-vocabulary drafting: translation through text is exact where it must be, and drafting with a
draft of another vocabulary reproduces plain decoding (greedy) and the target's distribution
(sampling).

Tokenizers used here:
- the byte-level tokenizer of ``conftest`` (260 ids, no merges): the ``tiny_pair`` target;
- ``merged``: a byte-level BPE with hand-written merges (`` foobar``, ``é``, ...): a draft of
  another vocabulary, and a target with merges for the pure translation tests;
- character-level tokenizers over 259 Latin letters + ``<eos>``, whose id sequences all round-trip
  through text (random byte-level outputs are mostly invalid UTF-8, which cannot): the targets
  of the oracle tests, where a draft that knows the target's text must be accepted.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.models.cache import KVCache
from specdecode.drafters.cross_vocab import CrossVocabDrafter, _CommittedText, _WindowedEncoder
from specdecode.drafters.vocab import continue_ids, same_vocabulary, stable_continuation
from specdecode.models.decoder import Decoder
from specdecode.tokenizer import Tokenizer, build_byte_level_bpe
from tests.conftest import EOS_ID, TINY_VOCAB, make_tiny_model, make_tiny_tokenizer, spec_k
from tests.test_sampling_lossless import assert_sampled_joint_is_exact

MERGED_VOCAB = 300
MERGED_WORDS = [" def", " return", " self", " class", " foobar", "    ", "\n\n", "é", "日本", "(x)", " x", "ab"]
CHARS = [chr(0x100 + i) for i in range(TINY_VOCAB)]  # id i <-> CHARS[i]; EOS_ID is "<eos>" instead


def _write_configs(path: Path, eos_id: int) -> None:
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))


def make_merged_tokenizer(path: Path) -> int:
    """A GPT-2 style byte-level BPE whose merges spell ``MERGED_WORDS``; returns its <eos> id."""
    from tokenizers import pre_tokenizers

    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges: list[str] = []
    for word in MERGED_WORDS:
        mapped = spell.pre_tokenize_str(word)[0][0]
        for i in range(1, len(mapped)):
            if mapped[: i + 1] not in tokens:
                merges.append(f"{mapped[:i]} {mapped[i]}")
                tokens.append(mapped[: i + 1])
    tokens.append("<eos>")
    assert len(tokens) <= MERGED_VOCAB
    eos = len(tokens) - 1
    build_byte_level_bpe(tokens, merges, special_ids=[eos], pre_type="gpt2").save(str(path / "tokenizer.json"))
    _write_configs(path, eos)
    return eos


def make_char_tokenizer(path: Path, ids: dict[str, int], merges: list[tuple[str, str]] = ()) -> None:
    """One id per character of ``CHARS`` (``ids``: its mapping, "<eos>" included); merged pairs
    get the next ids. No pre-tokenizer, so merges apply anywhere; decoding concatenates."""
    from tokenizers import Tokenizer as Backend, decoders, models

    vocab = dict(ids)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    backend = Backend(models.BPE(vocab=vocab, merges=list(merges)))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<eos>"])
    assert backend.token_to_id("<eos>") == ids["<eos>"]
    backend.save(str(path / "tokenizer.json"))
    _write_configs(path, ids["<eos>"])


def _char_ids(order: list[int]) -> dict[str, int]:
    """Character of target id t -> id ``order[t]``."""
    return {("<eos>" if t == EOS_ID else CHARS[t]): order[t] for t in range(TINY_VOCAB)}


@pytest.fixture(scope="module")
def merged_draft(tmp_path_factory) -> Path:
    """A random tiny draft of another vocabulary (300 ids, with merges)."""
    path = tmp_path_factory.mktemp("merged")
    make_tiny_model(path, "llama", vocab_size=MERGED_VOCAB, seed=3, tie_word_embeddings=False)
    make_merged_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tokenizers_(tmp_path_factory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("tokenizers")
    (root / "bytes").mkdir()
    (root / "merged").mkdir()
    make_tiny_tokenizer(root / "bytes")
    make_merged_tokenizer(root / "merged")
    return {name: Tokenizer.from_dir(root / name) for name in ("bytes", "merged")}


@pytest.fixture(scope="module")
def char_oracle(tmp_path_factory) -> tuple[Path, Path]:
    """A character-level target and the same weights behind a permuted vocabulary: a draft that
    predicts exactly the target's text, through other ids."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("oracle")
    target = make_tiny_model(root / "target", "qwen2", vocab_size=TINY_VOCAB, seed=10, tie_word_embeddings=False)
    make_char_tokenizer(target, _char_ids(list(range(TINY_VOCAB))))
    perm = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(7))  # target id -> draft id
    inverse = torch.argsort(perm)  # draft id -> target id
    model = AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[inverse])
        model.lm_head.weight.copy_(model.lm_head.weight[inverse])
    model.save_pretrained(root / "draft", safe_serialization=True)
    make_char_tokenizer(root / "draft", _char_ids(perm.tolist()))
    return target, root / "draft"


def _greedy(n: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _text_prompt(seed: int) -> str:
    rng = random.Random(seed)
    words = ["def", "f(x)", "return", "x", "+", "1", "\n", "class", "foobar", ":", "self", "é", "日本"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(3, 20)))


def _char_prompt(seed: int) -> str:
    rng = random.Random(seed)
    return "".join(CHARS[rng.randrange(EOS_ID)] for _ in range(rng.randint(3, 30)))


# --- same_vocabulary ---------------------------------------------------------------------------


def test_same_vocabulary(tokenizers_, tmp_path):
    byte, merged = tokenizers_["bytes"], tokenizers_["merged"]
    assert same_vocabulary(byte, byte, TINY_VOCAB, TINY_VOCAB)
    assert not same_vocabulary(byte, byte, TINY_VOCAB, TINY_VOCAB + 4)  # models of other sizes
    assert not same_vocabulary(byte, merged, TINY_VOCAB, MERGED_VOCAB)
    assert not same_vocabulary(byte, merged, MERGED_VOCAB, MERGED_VOCAB)  # same size, other ids
    # The merged tokenizer extends the byte tokens but orders them like the byte tokenizer does,
    # except <eos>: the draft gives "<eos>" another id.
    assert merged.token_to_id("<eos>") != byte.token_to_id("<eos>")
    perm = list(range(TINY_VOCAB))
    perm[0], perm[1] = perm[1], perm[0]
    for name, order in (("same", list(range(TINY_VOCAB))), ("swapped", perm)):
        (tmp_path / name).mkdir()
        make_char_tokenizer(tmp_path / name, _char_ids(order))
    same, swapped = Tokenizer.from_dir(tmp_path / "same"), Tokenizer.from_dir(tmp_path / "swapped")
    assert same_vocabulary(same, same, TINY_VOCAB, TINY_VOCAB)
    assert not same_vocabulary(same, swapped, TINY_VOCAB, TINY_VOCAB)
    (tmp_path / "extended").mkdir()  # the same ids plus draft-only tokens: drafts verify as ids
    make_char_tokenizer(tmp_path / "extended", _char_ids(list(range(TINY_VOCAB))), [(CHARS[1], CHARS[2])])
    extended = Tokenizer.from_dir(tmp_path / "extended")
    assert same_vocabulary(same, extended, MERGED_VOCAB, MERGED_VOCAB)
    assert not same_vocabulary(extended, same, MERGED_VOCAB, MERGED_VOCAB)  # the target's merged token is missing


# --- translation as pure functions ------------------------------------------------------------


def _spell(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


def test_continuation_without_boundary_effects(tokenizers_):
    tok = tokenizers_["merged"]
    tail = tok.encode("x = 1\n")
    out = continue_ids(tok, tail, 0, " return x")
    assert tok.decode(tail + out) == "x = 1\n return x"
    assert _spell(tok, out) == [" return", " x"]


def test_boundary_merge_falls_back_to_the_draft_text_alone(tokenizers_):
    tok = tokenizers_["merged"]
    tail = tok.encode("y = foo")
    assert _spell(tok, tail)[-1] == " foo"  # " foo" + "bar" would encode as " foobar"
    out = continue_ids(tok, tail, 0, "bar(x)")
    assert out == tok.encode("bar(x)")
    assert tok.decode(tail + out) == "y = foobar(x)"


def test_non_canonical_context_is_shortened(tokenizers_):
    tok = tokenizers_["merged"]
    # " def" spelled byte by byte (a tokenization the encoder never makes), then a newline.
    tail = tok.encode(" ") + tok.encode("d") + tok.encode("ef") + tok.encode("\n")
    out = continue_ids(tok, tail, 0, " self")
    assert _spell(tok, out) == [" self"]


def test_split_utf8_character_continues_the_pending_bytes(tokenizers_):
    byte = tokenizers_["bytes"]
    ids = byte.encode("aé!")
    tail, pending = ids[:2], 1  # "a" and the first byte of "é"
    assert byte.decode(tail).endswith("\ufffd")
    assert continue_ids(byte, tail, pending, "é!") == ids[2:]
    # With a merge for "é" its first byte alone is not canonical: no continuation exists.
    merged = tokenizers_["merged"]
    assert len(merged.encode("é")) == 1
    lone_lead = merged.token_to_id("\u00c3")  # byte 0xC3 (GPT-2 spells it as itself)
    assert continue_ids(merged, merged.encode("a") + [lone_lead], 1, "é!") is None


def test_word_still_being_spelled_is_dropped(tokenizers_):
    tok = tokenizers_["merged"]
    tail = tok.encode("x =")
    # " retur" -> " retur" (one token) but " return" is another token: nothing is certain yet.
    assert stable_continuation(tok, tail, 0, [" re", " retur"], False) == []
    # " return" survives one more draft token; " x" is the last token and is dropped.
    out = stable_continuation(tok, tail, 0, [" re", " return", " return x"], False)
    assert _spell(tok, out) == [" return"]
    # A draft that ended (end of sequence) keeps its last token.
    out = stable_continuation(tok, tail, 0, [" re", " return", " return x"], True)
    assert _spell(tok, out) == [" return", " x"]


def test_partial_character_at_the_end_of_the_draft_is_cut(tokenizers_):
    byte = tokenizers_["bytes"]
    tail = byte.encode("q")
    out = stable_continuation(byte, tail, 0, ["ab", "ab c", "ab c\ufffd"], False)
    assert byte.decode(out) == "ab"  # " c" is the last whole token; the broken character never shows
    # An end of sequence after a cut-off character is no real end: the last token is still dropped.
    assert stable_continuation(byte, tail, 0, ["ab", "ab c", "ab c\ufffd"], True) == byte.encode("ab")
    assert stable_continuation(byte, tail, 0, ["ab", "ab c"], True) == byte.encode("ab c")


def test_empty_draft(tokenizers_):
    tok = tokenizers_["merged"]
    tail = tok.encode("abc")
    assert stable_continuation(tok, tail, 0, [], False) == []
    assert stable_continuation(tok, tail, 0, [""], False) == []
    assert stable_continuation(tok, tail, 0, [" x"], False) == []  # a single token is never certain
    assert stable_continuation(tok, tail, 0, [" x"], True) == tok.encode(" x")


def test_committed_text_holds_back_split_characters(tokenizers_):
    byte = tokenizers_["bytes"]
    ids = byte.encode("ab日本c")  # 日 and 本 are 3 bytes each
    text = _CommittedText(byte)
    seen = []
    for n in range(1, len(ids) + 1):
        assert not text.update(ids[:n])
        assert "\ufffd" not in text.text
        assert text.text == byte.decode(ids[: text.clean])
        seen.append(text.clean)
    assert seen == [1, 2, 2, 2, 5, 5, 5, 8, 9]
    assert text.text == "ab日本c"


def test_committed_text_survives_invalid_bytes(tokenizers_):
    byte = tokenizers_["bytes"]
    rng = random.Random(0)
    ids = [rng.randrange(256) for _ in range(300)]
    text = _CommittedText(byte)
    rewrites = 0
    for n in range(1, len(ids) + 1):
        rewrites += text.update(ids[:n])
        assert n - 3 <= text.clean <= n
        if not text.text.endswith("\ufffd"):
            assert text.text == byte.decode(ids[: text.clean])
    assert rewrites < 30


def test_windowed_encoder_matches_a_full_encode(tokenizers_):
    tok = tokenizers_["merged"]
    rng = random.Random(1)
    text = ""
    encoder = _WindowedEncoder(tok)
    while len(text) < 4 * _WindowedEncoder.WINDOW:
        text += rng.choice([" def", " foobar", " return x", "\n\n", "    ", "é", "日本", "(x)", "ab"])
        assert encoder.encode(text) == tok.encode(text)
    assert encoder._anchor_chars > 2 * _WindowedEncoder.WINDOW  # it really only encodes a window


# --- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_llm(tiny_pair) -> LLM:
    target, _ = tiny_pair
    return LLM(model=str(target), max_seq_len=512, progress=False)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_identity_with_a_draft_of_another_vocabulary(byte_llm, merged_draft, k):
    drafter = CrossVocabDrafter(Decoder.from_dir(merged_draft, role="draft"),
                                Tokenizer.from_dir(merged_draft), byte_llm.tokenizer, 512)
    assert drafter.name == "draft_model" and drafter.cross_vocabulary
    drafted = 0
    for seed in range(5):
        ids = byte_llm.tokenizer.encode(_text_prompt(seed))
        plain = byte_llm.engine.generate(ids, _greedy())
        spec = byte_llm.engine.generate(ids, _greedy(), drafter, spec_k(k))
        assert spec.token_ids == plain.token_ids, (k, seed)
        assert len(spec.token_ids) == 40
        drafted += spec.stats.draft_tokens
        # The draft cache holds the draft encoding of the committed text (then drafts): after
        # rejections it must have been trimmed back, not appended to.
        context = drafter.draft_tokenizer.encode(drafter._text.text)
        assert drafter.cache.length == len(drafter._cached) and drafter._cached[: len(context)] == context
        _assert_cache_holds(drafter)
    assert drafted > 0, "nothing was drafted: the test would prove nothing"


def _assert_cache_holds(drafter: CrossVocabDrafter) -> None:
    """The draft cache's keys are those of a fresh forward over the ids it claims to hold."""
    fresh = drafter.model.new_cache(drafter.cache.capacity)
    drafter.model.forward(torch.tensor(drafter._cached), fresh)
    n = len(drafter._cached)
    torch.testing.assert_close(drafter.cache.k[:, :, :n], fresh.k[:, :, :n], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def char_llm(char_oracle) -> LLM:
    target, _ = char_oracle
    return LLM(model=str(target), max_seq_len=512, progress=False)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_permuted_vocabulary_oracle_is_accepted(char_llm, char_oracle, k):
    """The same weights behind other ids: after translation every draft should be the target's."""
    _, draft = char_oracle
    drafter = CrossVocabDrafter(Decoder.from_dir(draft, role="draft"), Tokenizer.from_dir(draft),
                                char_llm.tokenizer, 512)
    assert not same_vocabulary(char_llm.tokenizer, drafter.draft_tokenizer, TINY_VOCAB, TINY_VOCAB)
    accepted = drafted = steps = plain_steps = 0
    for seed in range(4):
        ids = char_llm.tokenizer.encode(_char_prompt(seed))
        plain = char_llm.engine.generate(ids, _greedy())
        spec = char_llm.engine.generate(ids, _greedy(), drafter, spec_k(k, adaptive=False))
        assert spec.token_ids == plain.token_ids, (k, seed)
        accepted, drafted = accepted + spec.stats.accepted_tokens, drafted + spec.stats.draft_tokens
        steps, plain_steps = steps + spec.stats.target_steps, plain_steps + plain.stats.target_steps
    assert drafted > 0 and accepted / drafted > 0.9
    if k > 1:
        assert steps < plain_steps / 1.5


class TextOracle:
    """A stand-in draft model that knows the target's output text: its next token is the first
    draft token of the rest of that text after what it has been fed (end of sequence past it)."""

    def __init__(self, tokenizer: Tokenizer, reference: str, vocab_size: int) -> None:
        self.tokenizer, self.reference, self.vocab_size = tokenizer, reference, vocab_size
        self.eos = min(tokenizer.eos_token_ids)
        self.ids: list[int] = []
        self.forwards = 0

    max_context = 100_000

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(1, 1, 1, capacity)

    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        del self.ids[cache.length:]  # the drafter trimmed the cache
        cache.reserve(tokens.shape[0])
        self.ids += tokens.tolist()
        self.forwards += 1
        seen = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        rest = self.reference[len(seen):] if self.reference.startswith(seen) else ""
        logits = torch.zeros(1, self.vocab_size)
        logits[0, (self.tokenizer.encode(rest) or [self.eos])[0]] = 1.0
        return logits


@pytest.mark.parametrize("k", [2, 5])
def test_text_oracle_with_merges_is_accepted(char_llm, tmp_path, k):
    """A draft tokenizer with merges (one draft token = several target tokens) and a draft that
    knows the text: translation must turn its text into exactly the target's tokens."""
    ids = char_llm.tokenizer.encode(_char_prompt(5))
    plain = char_llm.engine.generate(ids, _greedy(60))
    reference = char_llm.tokenizer.decode(ids + plain.token_ids, skip_special_tokens=False)
    output = char_llm.tokenizer.decode(plain.token_ids, skip_special_tokens=False)
    pairs = Counter(zip(output, output[1:]))
    merges = [(a, b) for (a, b), _ in pairs.most_common(40) if "<" not in a + b and ">" not in a + b]
    make_char_tokenizer(tmp_path, _char_ids(list(range(TINY_VOCAB))), merges)
    draft_tok = Tokenizer.from_dir(tmp_path)
    assert len(draft_tok.encode(output)) < 0.9 * len(plain.token_ids)  # merges really apply
    oracle = TextOracle(draft_tok, reference, draft_tok.vocab_size)
    drafter = CrossVocabDrafter(oracle, draft_tok, char_llm.tokenizer, 512)
    spec = char_llm.engine.generate(ids, _greedy(60), drafter, spec_k(k, adaptive=False))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted_tokens / spec.stats.draft_tokens > 0.9
    assert spec.stats.accepted_tokens >= 0.6 * len(plain.token_ids)


def test_sampling_has_the_exact_target_distribution(char_llm, char_oracle):
    _, draft = char_oracle
    model, tokenizer = Decoder.from_dir(draft, role="draft"), Tokenizer.from_dir(draft)
    ids = char_llm.tokenizer.encode(_char_prompt(2))[:12]
    assert_sampled_joint_is_exact(char_llm, ids, lambda: CrossVocabDrafter(model, tokenizer, char_llm.tokenizer, 64),
                                  adaptive=False)


def test_draft_end_of_sequence_becomes_the_target_end(char_llm, tmp_path):
    """A draft that says the text ends proposes the target's own end-of-sequence id."""
    make_char_tokenizer(tmp_path, _char_ids(list(range(TINY_VOCAB))), [(CHARS[1], CHARS[2])])
    draft_tok = Tokenizer.from_dir(tmp_path)
    prompt = char_llm.tokenizer.encode(CHARS[3] * 5)
    oracle = TextOracle(draft_tok, CHARS[3] * 5 + CHARS[1] + CHARS[2] + "<eos>", draft_tok.vocab_size)
    drafter = CrossVocabDrafter(oracle, draft_tok, char_llm.tokenizer, 64)
    from specdecode.sequence import SequenceState

    seq = SequenceState(list(prompt), len(prompt), _greedy())
    drafter.begin(seq)
    proposal = drafter.propose(seq, 8)
    assert proposal.probs is None
    assert proposal.tokens.tolist() == [1, 2, EOS_ID]
    assert drafter.propose(seq, 2).tokens.tolist() == [1, 2]  # at most k
    assert oracle.forwards <= 6  # the second propose reused the cached prompt


def test_confidence_stop_drafts_one_lookahead_token(char_llm, tmp_path):
    """An unsure draft stops, but one more token is drafted so the last kept one is known final."""
    make_char_tokenizer(tmp_path, _char_ids(list(range(TINY_VOCAB))), [(CHARS[1], CHARS[2])])
    draft_tok = Tokenizer.from_dir(tmp_path)
    prompt = char_llm.tokenizer.encode(CHARS[3] * 5)
    reference = CHARS[3] * 5 + CHARS[1] + CHARS[2] + "".join(CHARS[4:20])
    from specdecode.sequence import SequenceState

    seq = SequenceState(list(prompt), len(prompt), _greedy())
    for confidence, expected, forwards in ((0.5, [1, 2], 2), (0.0, [1, 2, 4, 5, 6, 7, 8, 9], 9)):
        oracle = TextOracle(draft_tok, reference, draft_tok.vocab_size)  # its top token has p ~ 0.01
        drafter = CrossVocabDrafter(oracle, draft_tok, char_llm.tokenizer, 64, confidence)
        drafter.begin(seq)
        assert drafter.propose(seq, 8).tokens.tolist() == expected, confidence
        assert oracle.forwards == forwards, confidence


def test_llm_switches_to_cross_vocabulary_mode_and_says_so_once(char_oracle, caplog):
    """``--method draft_model`` with a draft of another vocabulary translates instead of refusing."""
    from specdecode.errors import VocabularyMismatchError

    target, draft = char_oracle
    llm = LLM(model=str(target), draft=str(draft), max_seq_len=512, progress=False, draft_quantize="none")
    notices = caplog.text.count("cross-vocabulary mode")
    caplog.clear()
    assert notices == 1 and llm.draft_tokenizer is not None
    for method in ("draft_model", "combined"):
        prompt = _char_prompt(3)
        plain = llm.generate(prompt, _greedy(), method="none")[0]
        out = llm.generate(prompt, _greedy(), method=method)[0]
        assert out.token_ids == plain.token_ids, method
        assert out.stats.accepted_tokens > 0, method
    assert "cross-vocabulary" not in caplog.text  # said once, at load
    with pytest.raises(VocabularyMismatchError):
        llm.generate("abc", _greedy(4), method="tree")
