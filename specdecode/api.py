"""The Python API: ``LLM(...).generate / generate_n / chat / stream``.

``LLM`` loads the target (and optionally a draft model) once and keeps one drafter per method, so
a caller can compare methods on the same loaded weights (``method=`` on each call overrides the
default given at construction).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from specdecode.config import (DEFAULT_DRAFT_QUANTIZE, DEFAULT_DRAFT_VOCAB, DEFAULT_DRAFTS, DEFAULT_DTYPE, DEFAULT_MAX_SEQ_LEN,
                               DEFAULT_MODEL, ModelSpec, SpecConfig, default_method)
from specdecode.params import SamplingParams
from specdecode.drafters.base import Drafter
from specdecode.drafters.registry import REGISTRY, DraftResources, build_drafter
from specdecode.drafters.draft_vocab import restricted_draft
from specdecode.drafters.vocab import same_vocabulary
from specdecode.engine.engine import MAX_BATCH, Engine
from specdecode.engine.generation import GenerationOutput, StreamEvent
from specdecode.engine.openmp import release_pool
from specdecode.engine.samples import best, sample_params
from specdecode.models.watch import WATCH
from specdecode.models.prefix_cache import PrefixCache, companion, parse_memory
from specdecode.index.datastore import Datastore
from specdecode.index.history import SuffixHistory
from specdecode.errors import (InvalidConfigError, InvalidSamplingParamsError, UnsupportedModelError,
                               VocabularyMismatchError)
from specdecode.models.catalog import resolve_model
from specdecode.models.gguf_convert import MARKER_NAME
from specdecode.models import draft_quant, prefix_file
from specdecode.models.int8_rows import QUANTIZE_MODES
from specdecode.models.decoder import Decoder
from specdecode.drafters.self_spec.layers import default_skip, load_skip
from specdecode.heads.eagle3_format import load_head_for
from specdecode.heads.medusa_format import load_medusa_for
from specdecode.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class LLM:
    """A target model, an optional draft model, and the speculative methods over them."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        draft: str | None = None,
        *,
        dtype: str = DEFAULT_DTYPE,
        max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
        quantize: str | None = None,
        draft_quantize: str | None = DEFAULT_DRAFT_QUANTIZE,
        datastore: str | None = None,
        eagle_head: str | Path | None = None,
        medusa_heads: str | Path | None = None,
        progress: bool = True,
        prefix_cache: bool = True,
        kv_cache_memory: int | str | None = None,
        **spec: Any,
    ) -> None:
        """``spec``: any ``SpecConfig`` field (``method``: by default ``combined`` with a draft
        model, ``suffix`` without one, see ``config.default_method``; ``num_speculative_tokens``,
        ``adaptive``, ``draft_confidence``, ``draft_vocab``, ``ngram_min``/``ngram_max``,
        ``lookahead_*``), the defaults for every call; documented and validated there
        (``draft_vocab`` applies when the draft loads).
        ``draft_quantize``: "int4" (the default) gives the draft's decode steps 4-bit weights
        and one native call per forward (on x86 CPUs with AVX2, else int8 with a warning);
        "int8" gives it int8 weights; either way exactness is unaffected. None or "none" keeps it
        in ``dtype``, and the EAGLE and Medusa heads too (they draft in 4 bits otherwise). Without fbgemm (non-x86 builds of torch) the draft stays in ``dtype``, warned.
        ``datastore``: a folder made by ``specdecode index build`` for ``method="suffix"``, which
        also drafts from each prompt and from earlier requests without one.
        ``eagle_head``: a folder holding an EAGLE-3 head for this target (SpecForge or vLLM
        speculators layout), for ``method="eagle"``; checked against the target when loaded.
        ``medusa_heads``: a folder of Medusa heads for this target (vLLM's layout, or
        FasterDecoding's), for ``method="medusa"``.
        ``quantize``: how the *target* runs. "native" (the default for a model converted from
        GGUF, every catalog model) runs the GGUF's quantized weights as shipped through integer
        kernels, activations quantized per row; "none" (the default otherwise) runs float weights
        dequantized once; "int8" gives float32 weights per-row int8. Each is a slightly different
        model; every method is exact with respect to the one chosen, which ``method="none"`` runs.
        ``prefix_cache``: keep finished requests' KV caches, so a prompt that starts like an
        earlier one (the next turn of a conversation) prefills only the rest; the output is
        bitwise the same either way. ``kv_cache_memory``: bytes (or a size like "2GiB") all
        requests' KV caches may take, running and kept; by default a quarter of the machine's
        memory (``models/prefix_cache.py``)."""
        unknown = sorted(set(spec) - {f.name for f in dataclasses.fields(SpecConfig)})
        if unknown:
            raise InvalidConfigError(f"LLM() got unknown setting(s) {', '.join(unknown)}; the speculative ones are "
                                     f"{', '.join(f.name for f in dataclasses.fields(SpecConfig))}")
        if spec.get("method") is None:
            spec["method"] = default_method(model, draft)
        self.spec = SpecConfig(**spec)
        self.model_spec = ModelSpec(model, dtype, max_seq_len)
        if draft is None and REGISTRY[self.spec.method].needs_draft_model:
            draft = DEFAULT_DRAFTS.get(model)
            if draft is None:
                raise InvalidConfigError(f"method {self.spec.method!r} needs a draft model for {model!r}: pass draft= "
                                         "(on the command line, --draft)")
        path = resolve_model(model, progress=progress)
        self.tokenizer = Tokenizer.from_dir(path)
        # Checked before the weights load, so a wrong store fails in a second, not a minute.
        self.datastore = Datastore.open(datastore, tokenizer=self.tokenizer) if datastore else None
        self.quantize = target_quantize(quantize, dtype, path)
        try:
            self.target = Decoder.from_dir(path, dtype, quantize=self.quantize)
        except UnsupportedModelError as exc:
            if quantize is not None or self.quantize != "native":
                raise
            # Native is only the default: a GGUF with matrices no kernel runs (F16, Q2_K, ...)
            # runs dequantized instead, said once.
            log.warning(f"specdecode: running {model!r} dequantized to float32 ({exc})")
            self.quantize = None
            self.target = Decoder.from_dir(path, dtype)
        memory = parse_memory(kv_cache_memory) if kv_cache_memory is not None else None
        self.engine = Engine(self.target, self.tokenizer, max_seq_len, prefix_cache, memory)
        self.draft_prefixes: PrefixCache | None = None  # the draft model's, beside the engine's
        self._draft_source: tuple[Path, str | None] | None = None  # its folder and quantization
        WATCH.on_damage(self.clear_prefix_cache)  # kept prefixes computed from damaged weights go with them
        self.draft_model: Decoder | None = None
        self.draft_tokenizer: Tokenizer | None = None  # set when the draft speaks another vocabulary
        if draft is not None:
            # The draft's numerics never affect exactness, so it takes the fast single-row path.
            draft_quantize = draft_quant.usable_mode(draft_quantize, dtype)
            draft_path = resolve_model(draft, progress=progress)
            self.draft_model = Decoder.from_dir(draft_path, dtype, role="draft", quantize=draft_quantize)
            self._draft_source = (draft_path, draft_quantize)
            self.draft_tokenizer = self._foreign_tokenizer(draft, draft_path)
            if self.draft_tokenizer is None:  # the target's ids: its head may keep the frequent ones only
                self.draft_model = restricted_draft(self.draft_model, self.spec.draft_vocab, DEFAULT_DRAFT_VOCAB,
                                                    self.tokenizer)
                if prefix_cache:
                    self.draft_prefixes = companion(self.engine.caches, self.draft_model.new_cache)
            else:
                log.warning(f"specdecode: draft {draft!r} has another vocabulary than {model!r}: its drafts are "
                            "translated through text (cross-vocabulary mode; the output is still exact)")
        self.model_name, self.draft_name, self.model_dir = model, draft, path
        self._self_skip: list[int] | None = None  # layers --method self skips, read on first use
        self._drafters: dict[str, Drafter] = {}
        self.suffix_history = SuffixHistory()  # earlier requests' tokens, shared by suffix drafters
        self.eagle_head = load_head_for(eagle_head, self.target.config, path) if eagle_head is not None else None
        self.medusa_heads = (load_medusa_for(medusa_heads, self.target.config, path)
                             if medusa_heads is not None else None)
        self.resources = DraftResources(self.spec, self.target, self.tokenizer, self.draft_model,
                                        self.draft_tokenizer, draft, self.datastore, self.suffix_history,
                                        lambda: self.self_skip, self.eagle_head, self.medusa_heads,
                                        quantize_heads=draft_quantize not in (None, "none"),
                                        draft_prefixes=self.draft_prefixes)
        release_pool()  # loading started OpenMP workers here; the steps may run on another thread

    def clear_prefix_cache(self) -> None:
        """Forget every kept prefix (the target's and the draft model's): the next requests start
        cold, as a benchmark's conversations each should."""
        self.engine.caches.clear()
        if self.draft_prefixes is not None:
            self.draft_prefixes.clear()

    def save_prefix_cache(self, path: str | Path) -> int:
        """Write the kept prefixes (the target's, and the draft model's in their own part) to
        ``path`` atomically, for ``load_prefix_cache`` in a later process; returns the target
        tokens written. Raises ``PrefixCacheFileError`` when it cannot be written."""
        return prefix_file.save(Path(path), self._prefix_pools())["target"]

    def load_prefix_cache(self, path: str | Path) -> int:
        """Restore prefixes saved by ``save_prefix_cache`` into this LLM's pools, each part only
        when the model, dtype, quantization and numerics code it was saved with are this one's
        (``models/prefix_file.py``: the output stays bitwise that of an uncached run). A draft
        part that does not match (another draft, or none) is skipped with a warning, and the
        reverse. Returns the tokens restored (both parts). Raises ``PrefixCacheFileError`` when
        the file is unreadable, damaged, truncated or matches neither pool."""
        return sum(prefix_file.load(Path(path), self._prefix_pools()).values())

    def _prefix_pools(self) -> dict[str, prefix_file.Pool]:
        pools = {"target": prefix_file.Pool(self.engine.caches,
                                            prefix_file.model_identity(self.target, self.model_dir, self.quantize))}
        if self.draft_prefixes is not None and self._draft_source is not None:
            folder, mode = self._draft_source
            pools["draft"] = prefix_file.Pool(self.draft_prefixes, prefix_file.model_identity(self.draft_model, folder, mode))
        return pools

    def _foreign_tokenizer(self, draft: str, draft_path: Path) -> Tokenizer | None:
        """The draft's tokenizer when its drafts must be translated through text (another
        vocabulary), else None. A draft folder without a tokenizer is taken at its word when its
        vocabulary size matches, and refused otherwise."""
        target_size, draft_size = self.target.config.vocab_size, self.draft_model.config.vocab_size
        if not (draft_path / "tokenizer.json").is_file():
            if draft_size == target_size:
                return None
            raise VocabularyMismatchError(
                f"draft {draft!r} has a vocabulary of {draft_size} tokens but the target has {target_size}, "
                "and no tokenizer.json to translate its drafts with; use a draft of the same model family "
                "or a folder with its tokenizer")
        tokenizer = Tokenizer.from_dir(draft_path)
        return None if same_vocabulary(self.tokenizer, tokenizer, target_size, draft_size) else tokenizer

    def drafter(self, method: str | None = None) -> Drafter | None:
        """The (reused) drafter for ``method``; None for plain decoding."""
        method = self._method(method)
        if method != "none" and method not in self._drafters:
            self._drafters[method] = self.new_drafter(method)
        return self._drafters.get(method)

    def new_drafter(self, method: str | None = None, capacity: int | None = None) -> Drafter | None:
        """A fresh drafter with its own state, for one of several concurrent requests;
        ``capacity``: the most tokens its sequence will hold (sizes a draft model's cache)."""
        return build_drafter(self._method(method), self.resources, capacity or self.engine.max_seq_len)

    @property
    def self_skip(self) -> list[int]:
        """The target layers ``method="self"`` skips: the ``specdecode calibrate`` choice stored
        next to the model, else a default (about half the middle layers)."""
        if self._self_skip is None:
            cfg = self.target.config
            self._self_skip = load_skip(self.model_dir, cfg) or default_skip(cfg.num_layers)
        return self._self_skip

    def _method(self, method: str | None) -> str:
        return dataclasses.replace(self.spec, method=method).method if method else self.spec.method

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        method: str | None = None,
        num_speculative_tokens: int | None = None,
        *,
        adaptive: bool | None = None,
        max_batch: int = MAX_BATCH,
    ) -> list[GenerationOutput]:
        """Complete each prompt: raw text (no chat template) or token ids, one or a list.
        ``method``, ``num_speculative_tokens`` and ``adaptive`` override the LLM's settings for
        this call (validated like them). A list decodes as one batch of up to ``max_batch``
        running requests (``Engine.generate_many``): the outputs one call per prompt gives, in
        the prompts' order, in less time."""
        if isinstance(prompts, str) or _is_ids(prompts):
            prompts = [prompts]
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InvalidConfigError(f"max_batch must be a positive integer, got {max_batch!r}")
        if len(prompts) == 1:
            return [_output(self.events(prompts[0], params, method, num_speculative_tokens, adaptive=adaptive))]
        spec = self._spec(method, num_speculative_tokens, adaptive)
        params = params or SamplingParams()
        ids = [self._ids(p) for p in prompts]

        def new_drafter(prompt_ids: list[int]) -> Drafter | None:
            return self.new_drafter(spec.method, min(self.engine.max_seq_len, len(prompt_ids) + params.max_tokens))

        return self.engine.generate_many(ids, params, new_drafter, spec, max_batch)

    def generate_n(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        n: int = 1,
        method: str | None = None,
        num_speculative_tokens: int | None = None,
        *,
        best_of: int | None = None,
        adaptive: bool | None = None,
    ) -> list[GenerationOutput]:
        """``n`` samples of one prompt (raw text or token ids), as OpenAI's ``n``: a list of
        ``n`` outputs. A method of its own rather than an ``n`` on ``generate`` or
        ``SamplingParams``, so ``generate`` keeps returning one output per prompt.

        Sample i of a seeded ``params`` takes seed ``seed + i`` (vLLM's rule), so it equals
        ``generate`` with that seed; unseeded samples draw a seed each. The samples decode
        together and prefill the prompt once. ``best_of`` (at least ``n``): generate that many
        and return the ``n`` with the highest cumulative logprob, highest first (logprobs are
        computed to rank them, and returned only when ``params`` asks). Other arguments as
        ``generate``; see ``engine/samples.py``."""
        params = params or SamplingParams()
        count = n if best_of is None else best_of
        if not isinstance(n, int) or not isinstance(count, int) or not 1 <= n <= count:
            raise InvalidSamplingParamsError(f"need 1 <= n <= best_of, got n={n!r}, best_of={best_of!r}")
        ranked = count > n
        children = sample_params(params, count, ranked)
        spec = self._spec(method, num_speculative_tokens, adaptive)
        ids = self._ids(prompt)
        capacity = min(self.engine.max_seq_len, len(ids) + params.max_tokens)
        drafters = [self.new_drafter(spec.method, capacity) for _ in children]
        outputs = self.engine.generate_samples(ids, children, drafters, spec)
        return best(outputs, n, params.logprobs is not None) if ranked else outputs

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        params: SamplingParams | None = None,
        method: str | None = None,
        num_speculative_tokens: int | None = None,
        *,
        adaptive: bool | None = None,
    ) -> GenerationOutput:
        """Answer one conversation, formatted with the model's chat template."""
        return _output(self.events(self.chat_prompt_ids(messages), params, method, num_speculative_tokens,
                                   adaptive=adaptive))

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        method: str | None = None,
        num_speculative_tokens: int | None = None,
        *,
        adaptive: bool | None = None,
    ) -> Iterator[str]:
        """Yield text as it is accepted; the pieces join to ``generate``'s text."""
        for event in self.events(prompt, params, method, num_speculative_tokens, adaptive=adaptive):
            if event.text:
                yield event.text

    def events(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        method: str | None = None,
        num_speculative_tokens: int | None = None,
        *,
        adaptive: bool | None = None,
    ) -> Iterator[StreamEvent]:
        """The generation of one prompt (raw text or token ids) as it happens: each event carries
        the text and token ids accepted since the last, and the last event the whole
        ``GenerationOutput`` with its statistics."""
        spec = self._spec(method, num_speculative_tokens, adaptive)
        ids = self._ids(prompt)
        return self.engine.stream(ids, params or SamplingParams(), self.drafter(spec.method), spec)

    def _ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt's token ids: raw text encoded (no chat template), or the ids given."""
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    def _spec(self, method: str | None, num_speculative_tokens: int | None, adaptive: bool | None) -> SpecConfig:
        """The LLM's settings with a call's overrides (validated like them)."""
        overrides = {"method": method, "num_speculative_tokens": num_speculative_tokens, "adaptive": adaptive}
        return dataclasses.replace(self.spec, **{k: v for k, v in overrides.items() if v is not None})

    def chat_prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if not messages:
            raise InvalidConfigError("messages is empty: give at least one message")
        return self.tokenizer.encode_chat(list(messages))


def _is_ids(prompt: object) -> bool:
    """A prompt given as token ids (a non-empty sequence of ints), not a list of prompts."""
    return isinstance(prompt, Sequence) and bool(prompt) and all(isinstance(t, int) for t in prompt)


def _output(events: Iterator[StreamEvent]) -> GenerationOutput:
    for event in events:
        if event.output is not None:
            return event.output
    raise RuntimeError("the generation ended without its output")  # the engine always ends with one


def target_quantize(mode: str | None, dtype: str, path: Path) -> str | None:
    """The target's quantization: None for "none"; for None, "native" where ``path`` came from a
    GGUF file and ``dtype`` is float32, else None; "int8" needs float32 weights to quantize."""
    if mode is None:
        return "native" if dtype == "float32" and (path / MARKER_NAME).is_file() else None
    if mode == "none":
        return None
    if mode not in QUANTIZE_MODES + ("native",):
        raise InvalidConfigError(f"quantize must be native, none or {', '.join(QUANTIZE_MODES)}, got {mode!r}")
    if dtype != "float32":
        raise InvalidConfigError(f"quantize={mode!r} quantizes float32 weights; use dtype float32, not {dtype!r}")
    return mode
