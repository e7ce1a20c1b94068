"""Frozen, validated settings objects shared by the API, CLI, engine and server.

Validation lives in ``__post_init__`` so a bad value fails where it is created, with a message
that names the field, instead of deep inside the decode loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.drafters.registry import METHOD_NAMES
from specdecode.errors import InvalidConfigError
from specdecode.models.config import DRAFT_MODES, DTYPES
from specdecode.params import MAX_SPECULATIVE_TOKENS

# Up to 12 drafts per step: with the int4 draft, K=12 beat K=8 by 2-6% for draft_model, combined,
# tree and ngram in each of four bench runs on the AVX2 machine (docs/PERFORMANCE.md, "Design
# choices and their measurements").
DEFAULT_SPECULATIVE_TOKENS = 12
# Stop drafting once the draft's probability for its draft so far drops below this. 0.5 was the
# best of 0-0.7 (per-token and cumulative rules) on five workloads (docs/PERFORMANCE.md, "Design
# choices and their measurements"; the comparison is in the commit it names).
DEFAULT_DRAFT_CONFIDENCE = 0.5
# int4 drafts (one native call per draft forward) beat int8 in every category of a bench pair
# (docs/PERFORMANCE.md, "Design choices and their measurements"). The kernel needs AVX2 (it uses AVX-512 VNNI where
# present); without AVX2 int4 falls back to int8; "none" keeps the model dtype.
DRAFT_QUANTIZE_CHOICES = (*DRAFT_MODES, "none")
DEFAULT_DRAFT_QUANTIZE = "int4"
# The draft model's LM head computes the logits of this many tokens, the most frequent in text the
# target writes (``drafters/draft_vocab.py``), when the shipped ranking matches its tokenizer:
# the best expected speed of N in {8k, 16k, 32k, 64k, whole} from the measured agreement and the
# head's share of a draft step (docs/PERFORMANCE.md, "The draft's vocabulary").
DEFAULT_DRAFT_VOCAB = 65536
DEFAULT_DTYPE = "float32"
DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTS = {DEFAULT_MODEL: "qwen2.5-coder-0.5b-instruct"}  # the draft a method uses unless told
DEFAULT_MAX_SEQ_LEN = 4096  # context allocated per sequence
NGRAM_MIN, NGRAM_MAX = 1, 4  # the default n-gram lengths (also vLLM's prompt lookup in an export)
# Lookahead: at most 4 * 2 window rows + 3 * 2 candidate rows, kept few because every verify row
# costs compute on a CPU (docs/PERFORMANCE.md).
LOOKAHEAD_WINDOW, LOOKAHEAD_NGRAM, LOOKAHEAD_CANDIDATES = 4, 3, 3


def default_method(model: str, draft: str | None) -> str:
    """The method a run uses unless told: ``combined`` where a draft model is at hand (``draft``
    given, or the catalog's pair for ``model``), else ``suffix``. Both draft free copies from
    context matches first, and ``combined`` asks the draft model where that pays; the speculation
    policy decodes plainly where nothing pays, so the default is never much slower than ``none``
    (docs/BENCHMARKS.md has the figures)."""
    return "combined" if draft is not None or model in DEFAULT_DRAFTS else "suffix"


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Every speculative setting, each validated here once. ``LLM`` takes them as keywords;
    a per-call override is ``dataclasses.replace(spec, ...)``, which validates again."""

    method: str = "none"
    """The drafting method (``drafters.registry``); "none" is plain decoding."""
    num_speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS
    """Most drafts verified per step (K)."""
    adaptive: bool = True
    """The speculation policy (``engine/policy.py``) picks each request's draft length every step,
    up to K and 0 included, from measured costs and the request's acceptance; False: K every step."""
    draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE
    """At a fixed K (``adaptive=False``), a draft model stops drafting once its probability for
    the draft so far (the product of its token probabilities) falls below this; 0 never stops
    early. With ``adaptive``, the speculation policy sets this stop each step from costs."""
    draft_temperature: float | None = None
    """How a draft model drafts for a sampled request: None follows the request's own rule (it
    races its own distribution with the keys the target's sample uses, ``sample/race.py``); 0
    proposes its argmax (deterministic drafts, as the seed papers advise); t > 0 races its
    distribution at temperature t. Greedy requests always get argmax drafts. Any choice is exact:
    a sampled request's verification keeps exactly the target's sample whatever was drafted."""
    draft_vocab: int | None = None
    """A draft model's LM head computes only the logits of this many tokens, those the target
    writes most (the shipped ranking; exactness is unaffected): 0 is the whole head, None the
    default (``DEFAULT_DRAFT_VOCAB`` when the ranking matches the draft's tokenizer, else the
    whole head). Applied when the draft loads."""
    ngram_min: int = NGRAM_MIN
    """Shortest context suffix the n-gram drafter tries to match."""
    ngram_max: int = NGRAM_MAX
    """Longest suffix it tries first (the combined and tree drafters' matches too)."""
    combined_min_match: int = 2
    """Shortest context match ``combined`` offers a copy from; the speculation policy then
    chooses between the copy and the draft model by what each earned so far."""
    tree_ngram_min: int = 2
    """Shortest context match whose continuation ``tree`` adds as a branch."""
    lookahead_window: int = LOOKAHEAD_WINDOW
    """Columns of the lookahead window (``method="lookahead"``)."""
    lookahead_ngram: int = LOOKAHEAD_NGRAM
    """Size of the n-grams lookahead collects and verifies."""
    lookahead_candidates: int = LOOKAHEAD_CANDIDATES
    """n-grams lookahead verifies per step."""
    head_tree_width: int = 0
    """Trained heads (``eagle``, ``medusa``): 0 drafts a chain; w > 0 drafts a token tree of at
    most K nodes, expanding the w most probable paths by their w most probable tokens."""
    head_tree_depth: int = 6
    """The deepest level such a tree reaches."""
    synthetic_acceptance: tuple[float, ...] | None = None
    """For benchmarks only: draft position i is kept with probability ``rates[min(i, len - 1)]``
    given the earlier ones were, whatever the target says, so the output is *not* the target's
    (``sample/synthetic.py``). None (the default): the exact rules."""

    def __post_init__(self) -> None:
        if self.method not in METHOD_NAMES:
            raise InvalidConfigError(f"unknown method {self.method!r}; choose one of {', '.join(METHOD_NAMES)}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidConfigError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}"
            )
        if not 0.0 <= self.draft_confidence < 1.0:
            raise InvalidConfigError(f"draft_confidence must be in [0, 1), got {self.draft_confidence}")
        if self.draft_temperature is not None and not (math.isfinite(self.draft_temperature)
                                                       and self.draft_temperature >= 0):
            raise InvalidConfigError(f"draft_temperature must be >= 0 (0: argmax drafts), got {self.draft_temperature}")
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise InvalidConfigError(f"draft_vocab must be >= 0 (0: the whole head), got {self.draft_vocab}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidConfigError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
            )
        if self.combined_min_match < 1 or self.tree_ngram_min < 1:
            raise InvalidConfigError(f"combined_min_match and tree_ngram_min must be >= 1, got "
                                     f"{self.combined_min_match} and {self.tree_ngram_min}")
        if self.head_tree_width < 0 or self.head_tree_depth < 1:
            raise InvalidConfigError(f"need head_tree_width >= 0 and head_tree_depth >= 1, got "
                                     f"{self.head_tree_width} and {self.head_tree_depth}")
        if self.synthetic_acceptance is not None:
            rates = tuple(float(r) for r in self.synthetic_acceptance)
            if not rates or not all(0.0 <= r <= 1.0 for r in rates):
                raise InvalidConfigError(f"synthetic_acceptance takes rates in [0, 1], got {self.synthetic_acceptance}")
            object.__setattr__(self, "synthetic_acceptance", rates)
        if self.lookahead_window < 1 or self.lookahead_ngram < 2 or self.lookahead_candidates < 0:
            raise InvalidConfigError(
                "lookahead needs window >= 1, ngram >= 2 and candidates >= 0; got "
                f"{self.lookahead_window}, {self.lookahead_ngram}, {self.lookahead_candidates}")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model to load: a catalog name, a local folder or GGUF file, or a hub id."""

    name: str
    dtype: str = "float32"
    max_seq_len: int | None = None  # None: the model's own context length, capped by the engine

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise InvalidConfigError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
