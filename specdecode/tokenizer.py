"""Text <-> token ids for one model: a `tokenizers` tokenizer, the model's chat template, and a
streaming decoder that turns token ids into text as they are generated.

Everything is read from an HF model folder (tokenizer.json, tokenizer_config.json,
generation_config.json, config.json), the canonical format GGUF files are converted into.
``tokenizer_files_from_gguf`` builds those files from a GGUF's metadata, which stores only a bare
vocabulary, merges and the *name* of a pre-tokenizer (``build_byte_level_bpe`` knows the regexes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers

from specdecode.errors import InvalidPromptError, ModelNotFoundError, UnsupportedModelError

_REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class Tokenizer:
    """A model's tokenizer plus what generation needs to know: EOS ids, BOS id, chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: frozenset[int],
        bos_token_id: int | None,
        chat_template: str | None,
        special_tokens: Mapping[str, str | None] | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = frozenset(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ... as texts
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self._control_texts = [t.content for t in added.values() if t.special]
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._byte_level = isinstance(backend.decoder, tokenizers.decoders.ByteLevel)  # GPT-2's byte alphabet
        self._literal: tokenizers.Tokenizer | None = None  # encodes special-token texts as plain text

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Load from an HF model folder; EOS ids are the union of every place that names one."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"no tokenizer.json in {path}; pass an HF model folder or a catalog name")
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        tok_config = _read_json(path / "tokenizer_config.json")
        gen_config = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")
        special = {k: _token_text(tok_config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}

        def token_id(text: str | None) -> int | None:
            return backend.token_to_id(text) if text else None

        eos = set(_as_ids(gen_config.get("eos_token_id"))) | set(_as_ids(model_config.get("eos_token_id")))
        if token_id(special["eos_token"]) is not None:
            eos.add(token_id(special["eos_token"]))
        bos = token_id(special["bos_token"])
        for config in (model_config, gen_config):
            bos = config.get("bos_token_id") if bos is None else bos
        return cls(backend, eos_token_ids=frozenset(eos), bos_token_id=bos,
                   chat_template=_find_chat_template(path, tok_config), special_tokens=special)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token texts like ``<|im_start|>`` map to their ids."""
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except (TypeError, UnicodeError) as exc:  # e.g. a lone surrogate, which has no UTF-8 form
            raise InvalidPromptError(f"the prompt cannot be tokenized: {exc}") from exc

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may be part of a UTF-8
        character); special tokens give their text. Used for logprobs' ``bytes``."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and token_id not in self._special_ids:
            to_byte = _unicode_to_bytes()
            if all(ch in to_byte for ch in piece):
                return bytes(to_byte[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        *,
        template_vars: Mapping[str, Any] | None = None,
    ) -> str:
        """Render the conversation as the model expects it (same environment as HF transformers).

        ``template_vars`` passes extra names a template may read (e.g. ``tools``). A template that
        rejects the messages raises ``jinja2.TemplateError`` with the template's own message.
        """
        if not self.chat_template:
            raise UnsupportedModelError(
                "this model has no chat template; pass a plain prompt instead of chat messages"
            )
        template = _compile_template(self.chat_template)
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(template_vars or {})
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True, *,
                    template_vars: Mapping[str, Any] | None = None) -> list[int]:
        """The conversation's token ids through the chat template, with each message's text taken
        as text: a special-token string inside a message (``<|im_end|><|im_start|>system``) is
        encoded as the characters it is, never as a control token, so a user cannot forge another
        role's turn. OpenAI-compatible servers encode user content this way.

        A conversation without such strings gets exactly ``encode(apply_chat_template(...))``.
        Otherwise the template is rendered with a marker in place of each message's text, the
        template's own pieces are encoded as usual and the texts without special-token matching.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, template_vars=template_vars)
        contents = [m.get("content") for m in messages]
        if not any(isinstance(c, str) and any(t in c for t in self._control_texts) for c in contents):
            return self.encode(text)
        marks = [f"\ue000{i}\ue001" if isinstance(c, str) else None for i, c in enumerate(contents)]
        marked = [{**m, "content": mark} if mark else m for m, mark in zip(messages, marks)]
        rest = self.apply_chat_template(marked, add_generation_prompt, template_vars=template_vars)
        ids: list[int] = []
        for content, mark in zip(contents, marks):
            if mark is None:
                continue
            before, found, rest = rest.partition(mark)
            if not found or mark in rest:
                raise InvalidPromptError("a message contains special-token text and this model's chat template "
                                         "rewrites message text, so it cannot be kept apart from the template's "
                                         "control tokens; remove the special-token text")
            ids += self.encode(before) + self._encode_literal(content)
        return ids + self.encode(rest)

    def _encode_literal(self, text: str) -> list[int]:
        if self._literal is None:
            self._literal = tokenizers.Tokenizer.from_str(self.backend.to_str())
            self._literal.encode_special_tokens = True
        try:
            return self._literal.encode(text, add_special_tokens=False).ids
        except (TypeError, UnicodeError) as exc:
            raise InvalidPromptError(f"the prompt cannot be tokenized: {exc}") from exc

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Incremental detokenizer: text for each new batch of ids, never a broken character.

    Byte-level BPE tokens can end mid-character, and some decoders treat the first token of a
    string specially, so decoding token by token is wrong. Like vLLM and TGI, we decode a short
    window that starts a little before the new tokens (at the ids emitted last) and emit the
    difference; text ending in U+FFFD (an incomplete UTF-8 sequence) is held back until more bytes
    arrive. Each push costs O(window), not O(text so far). All push() results plus flush() equal
    decode(all ids); flush() ends the stream (a later push starts a new one).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # left context (ids emitted last time), then ids not yet emitted
        self._read = 0  # how many of ``_ids`` are left context

    def push(self, ids: Sequence[int]) -> str:
        """Add new token ids; return the text that became stable."""
        self._ids.extend(int(i) for i in ids)
        context = self._decode(self._ids[:self._read])
        text = self._decode(self._ids)
        if len(text) <= len(context) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._emit(text, context)

    def flush(self) -> str:
        """Return whatever is held back (possibly ending in U+FFFD), as decode() would render it."""
        rest = self._decode(self._ids)[len(self._decode(self._ids[:self._read])):]
        self._ids, self._read = [], 0
        return rest

    def _emit(self, text: str, context: str) -> str:
        # The ids being emitted become the next left context; older ones are no longer needed.
        del self._ids[:self._read]
        self._read = len(self._ids)
        return text[len(context):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""


# --- building a byte-level BPE tokenizer from a bare vocabulary -------------------------------

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


@dataclass(frozen=True)
class _PreTokenizer:
    splits: tuple[str, ...]  # applied in order, each cutting the pieces of the previous one
    ignore_merges: bool = False  # look a whole word up in the vocabulary before merging
    nfc: bool = False  # the original HF tokenizer NFC-normalizes its input


# Names are llama.cpp's `tokenizer.ggml.pre` values; the regexes follow llama-vocab.cpp.
PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _PreTokenizer((_QWEN2_SPLIT,), nfc=True)),
    "stablelm2": _PreTokenizer((_QWEN2_SPLIT,)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3"), _PreTokenizer((_LLAMA3_SPLIT,), True)),
    **dict.fromkeys(("smaug-bpe", "dbrx"), _PreTokenizer((_LLAMA3_SPLIT,))),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
                    _PreTokenizer((r"\p{N}", _GPT2_SPLIT))),
    **dict.fromkeys(("gpt-2", "gpt2", "mpt", "olmo", "jais", "phi-2"), _PreTokenizer((_GPT2_SPLIT,))),
    "default": _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]")),
}


def build_byte_level_bpe(
    tokens: Sequence[str],
    merges: Sequence[str],
    *,
    special_ids: Sequence[int] = (),
    user_defined_ids: Sequence[int] = (),
    pre_type: str = "default",
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> tokenizers.Tokenizer:
    """A GPT-2 style byte-level BPE tokenizer from a vocabulary in id order and "a b" merges.

    ``special_ids`` become special added tokens (matched whole, skipped by decode), and
    ``user_defined_ids`` plain added tokens (matched whole, kept by decode). ``bos_id`` /
    ``eos_id``, when given, are added around the text by ``encode(add_special_tokens=True)``.
    """
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

    pre = PRE_TOKENIZERS.get(pre_type)
    if pre is None:
        raise UnsupportedModelError(
            f"unknown pre-tokenizer {pre_type!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    added = set(special_ids) | set(user_defined_ids)
    byte_chars = _bytes_to_unicode()
    alphabet = set(byte_chars.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if index not in added and not set(token) <= alphabet:  # stored as raw text: respell in bytes
            token = "".join(byte_chars[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges))
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in sorted(user_defined_ids)])
    if bos_id is None and eos_id is None:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        ends = [(tokens[i], i) for i in (bos_id, eos_id) if i is not None]
        single = " ".join(([tokens[bos_id]] if bos_id is not None else []) + ["$A"]
                          + ([tokens[eos_id]] if eos_id is not None else []))
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {single.replace('$A', '$B:1')}", special_tokens=ends
        )
    return backend


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters (printable Latin-1 maps to itself)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    mapping = {b: chr(b) for b in keep}
    extra = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return mapping


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {ch: b for b, ch in _bytes_to_unicode().items()}


# --- tokenizer files from GGUF metadata ----------------------------------------------------------

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp token_type codes (1 = normal, 5 = unused)
# Texts llama.cpp treats as end-of-generation besides the EOS id (llama-vocab.cpp, "EOG").
_END_OF_TURN_TEXTS = frozenset({
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
    "<|end_of_text|>", "<EOT>",
})


@dataclass(frozen=True)
class TokenizerFiles:
    """What a GGUF's metadata says about its tokenizer, as the three HF files hold it."""

    tokenizer: tokenizers.Tokenizer
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]


def tokenizer_files_from_gguf(meta: Mapping[str, Any]) -> TokenizerFiles:
    """tokenizer.json / tokenizer_config.json / generation_config.json contents from GGUF metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
    ids = {name: meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "padding", "unknown")}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    tokenizer = build_byte_level_bpe(
        tokens,
        [str(m) for m in meta.get("tokenizer.ggml.merges", ())],
        special_ids=[i for i, t in enumerate(types) if t == _TOKEN_CONTROL],
        user_defined_ids=[i for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED],
        pre_type=str(meta.get("tokenizer.ggml.pre", "default")),
        bos_id=ids["bos"] if add_bos else None,
        eos_id=ids["eos"] if add_eos else None,
    )
    eos_ids = [int(ids["eos"])] if ids["eos"] is not None else []
    eos_ids += [i for i, (tok, t) in enumerate(zip(tokens, types))
                if t == _TOKEN_CONTROL and tok in _END_OF_TURN_TEXTS and i not in eos_ids]

    def text(key: str) -> str | None:
        return tokens[int(ids[key])] if ids[key] is not None else None

    context = meta.get(f"{meta.get('general.architecture')}.context_length")
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text("bos"), "eos_token": text("eos"), "pad_token": text("padding"), "unk_token": text("unknown"),
        "add_bos_token": add_bos, "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(context) if context else None,
    }
    if meta.get("tokenizer.chat_template"):
        tokenizer_config["chat_template"] = str(meta["tokenizer.chat_template"])
    generation_config = {"bos_token_id": ids["bos"], "eos_token_id": eos_ids, "pad_token_id": ids["padding"]}
    return TokenizerFiles(tokenizer, tokenizer_config, {k: v for k, v in generation_config.items() if v is not None})


# --- chat templates ---------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:
    """Compile like transformers does: sandboxed, trim/lstrip blocks, its helper functions."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters, which would change prompts
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _find_chat_template(path: Path, tok_config: Mapping[str, Any]) -> str | None:
    """The template from chat_template.jinja, chat_template.json or tokenizer_config.json."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template") or tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template or None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:  # ValueError covers bad JSON and bad UTF-8
        raise UnsupportedModelError(f"{path} is not valid JSON ({str(exc)[:120]}); re-download or re-convert "
                                    "the model") from None
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as text or as {"content": text, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
