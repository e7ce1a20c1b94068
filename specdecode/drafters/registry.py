"""Every speculative method by name: how to build its drafter, whether it needs a draft model, and
its one line of help.

Adding a method is one drafter module and one row in ``REGISTRY``; the API, the CLI's choices and
help, the bench, the server, ``config`` (which validates method names against it) and the tests
(every registered method gets the losslessness tests) all read this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdecode.errors import InvalidConfigError, VocabularyMismatchError

if TYPE_CHECKING:
    from specdecode.config import SpecConfig
    from specdecode.drafters.base import Drafter
    from specdecode.models.prefix_cache import PrefixCache
    from specdecode.heads.eagle3 import Eagle3Head
    from specdecode.heads.medusa import MedusaHeads
    from specdecode.index.datastore import Datastore
    from specdecode.index.history import SuffixHistory
    from specdecode.models.decoder import Decoder
    from specdecode.tokenizer import Tokenizer


@dataclass(frozen=True)
class DraftResources:
    """What drafters are built from, gathered once by ``LLM``."""

    spec: SpecConfig
    target: Decoder
    tokenizer: Tokenizer
    draft_model: Decoder | None  # None: no draft model loaded
    draft_tokenizer: Tokenizer | None  # set when the draft model speaks another vocabulary
    draft_name: str | None
    datastore: Datastore | None  # ``specdecode index build`` output, for ``suffix``
    suffix_history: SuffixHistory  # earlier requests' tokens, shared by every suffix drafter
    self_skip: Callable[[], list[int]]  # the layers ``self`` skips, read on first use
    eagle_head: Eagle3Head | None = None  # a trained EAGLE-3 head for this target
    medusa_heads: MedusaHeads | None = None  # trained Medusa heads for this target
    quantize_heads: bool = True  # heads draft in 4 bits (draft_heads.draft_copy); False with --draft-quantize none
    draft_prefixes: PrefixCache | None = None  # the draft model's prefix cache (same vocabulary only)


@dataclass(frozen=True)
class Method:
    name: str
    help: str
    build: Callable[[DraftResources, int], Drafter | None]  # (resources, capacity in tokens); see build_drafter
    needs_draft_model: bool = False
    needs: str | None = None  # a DraftResources field that must be set, and how to set it
    needs_hint: str = ""


def _ngram(r: DraftResources, capacity: int) -> Drafter:
    from specdecode.drafters.ngram import NgramDrafter

    return NgramDrafter(r.spec.ngram_min, r.spec.ngram_max)


def _lookahead(r: DraftResources, capacity: int) -> Drafter:
    from specdecode.drafters.lookahead import LookaheadDrafter

    return LookaheadDrafter(r.spec.lookahead_window, r.spec.lookahead_ngram, r.spec.lookahead_candidates)


def _suffix(r: DraftResources, capacity: int) -> Drafter:
    from specdecode.drafters.suffix import SuffixDrafter

    return SuffixDrafter(r.datastore, r.suffix_history)


def _self(r: DraftResources, capacity: int) -> Drafter:
    from specdecode.drafters.self_spec.drafter import SelfSpecDrafter

    return SelfSpecDrafter(r.target, r.self_skip(), capacity, r.spec.draft_confidence)


def _draft_model(r: DraftResources, capacity: int) -> Drafter:
    """The draft model drafting token by token, through text when its vocabulary differs."""
    from specdecode.drafters.cross_vocab import CrossVocabDrafter
    from specdecode.drafters.draft_model import DraftModelDrafter

    if r.draft_tokenizer is not None:
        return CrossVocabDrafter(r.draft_model, r.draft_tokenizer, r.tokenizer, capacity, r.spec.draft_confidence)
    return DraftModelDrafter(r.draft_model, r.target.config.vocab_size, capacity, r.spec.draft_confidence,
                             r.draft_prefixes, r.spec.draft_temperature)


def _tree(r: DraftResources, capacity: int) -> Drafter:
    from specdecode.drafters.tree import TreeDrafter

    if r.draft_tokenizer is not None:
        raise VocabularyMismatchError(f"method 'tree' branches on the draft's own token choices and needs a draft "
                                      f"of the target's vocabulary; {r.draft_name!r} has another one (use "
                                      "draft_model or combined with it)")
    return TreeDrafter(_draft_model(r, capacity), ngram_min=r.spec.tree_ngram_min,
                       ngram_max=max(r.spec.tree_ngram_min, r.spec.ngram_max))


def _combined(r: DraftResources, capacity: int) -> Drafter:
    from specdecode.drafters.combined import CombinedDrafter
    from specdecode.drafters.suffix import SuffixDrafter

    copy = SuffixDrafter(r.datastore, r.suffix_history, min_match=r.spec.combined_min_match)
    return CombinedDrafter(_draft_model(r, capacity), copy)


def _eagle(r: DraftResources, capacity: int) -> Drafter:
    from specdecode.drafters.eagle import EagleDrafter

    return EagleDrafter(r.eagle_head, r.target, capacity, r.spec.draft_confidence, r.spec.head_tree_width,
                        r.spec.head_tree_depth, quantize=r.quantize_heads)


def _medusa(r: DraftResources, capacity: int) -> Drafter:
    from specdecode.drafters.medusa import MedusaDrafter

    return MedusaDrafter(r.medusa_heads, r.target, r.spec.draft_confidence, r.spec.head_tree_width,
                         quantize=r.quantize_heads)


REGISTRY: dict[str, Method] = {m.name: m for m in (
    Method("none", "plain decoding", lambda r, capacity: None),
    Method("ngram", "prompt lookup", _ngram),
    Method("draft_model", "a small model drafts (one of another vocabulary drafts through text)", _draft_model,
           needs_draft_model=True),
    Method("combined", "copies from context matches (prompt, earlier requests, --datastore) when they pay, else the "
                       "draft model; the default with a draft model", _combined, needs_draft_model=True),
    Method("tree", "the draft model's chain plus its second choices and n-gram copies, verified as one token tree",
           _tree, needs_draft_model=True),
    Method("lookahead", "Jacobi n-grams guessed and checked in the same forward", _lookahead),
    Method("suffix", "the longest seen suffix's most frequent continuation (prompt, earlier requests, "
                     "--datastore)", _suffix),
    Method("self", "the target drafts with some of its layers skipped (see `specdecode calibrate`)", _self),
    Method("eagle", "a trained EAGLE-3 head drafts from the target's hidden states (--eagle-head DIR)", _eagle,
           needs="eagle_head", needs_hint="pass eagle_head= (--eagle-head DIR), a head made by "
                                          "`specdecode train eagle3` or an EAGLE-3 head for this target"),
    Method("medusa", "trained Medusa heads guess the next tokens from the target's last hidden state "
                     "(--medusa-heads DIR)", _medusa,
           needs="medusa_heads", needs_hint="pass medusa_heads= (--medusa-heads DIR), heads made by "
                                            "`specdecode train medusa` or Medusa heads for this target"),
)}
METHOD_NAMES = tuple(REGISTRY)
DRAFT_MODEL_METHODS = tuple(name for name, m in REGISTRY.items() if m.needs_draft_model)


def build_drafter(name: str, resources: DraftResources, capacity: int) -> Drafter | None:
    """A fresh drafter of method ``name`` (None for plain decoding), for a sequence of at most
    ``capacity`` tokens."""
    method = REGISTRY[name]
    if method.needs_draft_model and resources.draft_model is None:
        raise InvalidConfigError(f"method {name!r} needs a draft model: pass draft= (on the command line, --draft)")
    if method.needs is not None and getattr(resources, method.needs) is None:
        raise InvalidConfigError(f"method {name!r} needs a trained head: {method.needs_hint}")
    return method.build(resources, capacity)


def method_help() -> str:
    """Every method with its help, for ``--method`` and ``--methods``."""
    return "; ".join(f"{m.name} = {m.help}" for m in REGISTRY.values())
