"""Which tokens a draft model's restricted LM head keeps: a ranking of the vocabulary by how often
the target writes each token, shipped with the package for the default pair's tokenizer.

A draft proposes what it expects the target to write, so the tokens worth computing logits for are
the ones the target writes most. The ranking is counted from the target's own greedy answers to
calibration prompts (``scripts/draft_vocab_rank.py`` makes it; those prompts are disjoint from the
ones ``specdecode bench --limit 3`` runs, so benchmarks of a restricted draft stay honest). Its
order: the tokenizer's special tokens (EOS must always be draftable), then the tokens seen, most
frequent first, then every other id in increasing order (a lower BPE id is an earlier merge, a
more frequent piece of the tokenizer's own corpus). The file stores only the first two groups.

Token ids mean nothing under another tokenizer, so the file records the tokenizer's fingerprint
and vocabulary size: ``draft_vocab_ids`` refuses an explicit size for another tokenizer and leaves
the head whole when the size was the default.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from typing import TYPE_CHECKING

from specdecode.errors import VocabularyRankingError
from specdecode.index.fingerprint import tokenizer_fingerprint
from specdecode.tokenizer import Tokenizer

if TYPE_CHECKING:
    from specdecode.models.decoder import Decoder

log = logging.getLogger(__name__)

RANKING_PATH = Path(__file__).resolve().parent.parent / "data" / "draft_vocab_qwen2.5.json"
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class VocabRanking:
    """A vocabulary of ``vocab_size`` ids ranked for drafting: ``ranked`` first (special tokens,
    then the tokens the target wrote by count), then every other id in increasing order."""

    vocab_size: int
    tokenizer_fingerprint: str
    ranked: tuple[int, ...]
    source: str = ""  # how the counts were made: the command, model, prompts and tokens counted

    def top(self, n: int) -> Tensor:
        """The ``n`` highest-ranked ids (all of them if ``n`` >= the vocabulary), sorted
        increasing so a tie in the draft's argmax goes to the lower id, as over the full head."""
        if n < 1:
            raise VocabularyRankingError(f"a restricted draft vocabulary needs at least 1 token, got {n}")
        head = list(self.ranked[:n])
        if len(head) < n:
            seen = set(self.ranked)
            head += [i for i in range(self.vocab_size) if i not in seen][: n - len(head)]
        return torch.tensor(sorted(head), dtype=torch.long)

    def matches(self, tokenizer: Tokenizer, vocab_size: int) -> bool:
        return vocab_size == self.vocab_size and tokenizer_fingerprint(tokenizer) == self.tokenizer_fingerprint


def rank_tokens(counts: Counter[int], special_ids: Iterable[int], vocab_size: int) -> tuple[int, ...]:
    """The stored part of a ranking: ``special_ids`` (increasing), then the counted ids by count
    (ties by id); ids outside the vocabulary are left out."""
    specials = sorted({i for i in special_ids if 0 <= i < vocab_size})
    taken = set(specials)
    seen = sorted((i for i in counts if 0 <= i < vocab_size and i not in taken), key=lambda i: (-counts[i], i))
    return (*specials, *seen)


def special_ids(tokenizer: Tokenizer) -> set[int]:
    """The tokenizer's added (special) tokens and EOS ids: always in a restricted vocabulary."""
    added = tokenizer.backend.get_added_tokens_decoder()
    return set(added) | set(tokenizer.eos_token_ids)


def save_ranking(ranking: VocabRanking, path: Path) -> None:
    data = {"format": FORMAT_VERSION, "vocab_size": ranking.vocab_size,
            "tokenizer_fingerprint": ranking.tokenizer_fingerprint, "source": ranking.source,
            "ranked": list(ranking.ranked)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")


def load_ranking(path: Path = RANKING_PATH) -> VocabRanking:
    """The ranking stored at ``path``, or ``VocabularyRankingError`` naming what is wrong."""
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT_VERSION}")
        return VocabRanking(int(data["vocab_size"]), str(data["tokenizer_fingerprint"]),
                            tuple(int(i) for i in data["ranked"]), str(data.get("source", "")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise VocabularyRankingError(f"cannot read the draft vocabulary ranking {path}: {exc}; regenerate it with "
                                     "scripts/draft_vocab_rank.py") from exc


def draft_vocab_ids(size: int | None, default: int, tokenizer: Tokenizer, vocab_size: int,
                    path: Path = RANKING_PATH) -> Tensor | None:
    """The token ids a draft's LM head keeps, or None for the whole head.

    ``size``: 0 keeps the whole head; N > 0 the N top-ranked tokens (refused, by name, when the
    ranking was made for another tokenizer); None means ``default`` when the ranking matches
    ``tokenizer`` and ``vocab_size`` (the draft's full vocabulary), else the whole head."""
    wanted = default if size is None else size
    if wanted == 0 or wanted >= vocab_size:
        return None
    ranking = load_ranking(path)
    if ranking.matches(tokenizer, vocab_size):
        return ranking.top(wanted)
    if size is None:
        log.info("specdecode: the draft vocabulary ranking is for another tokenizer; the draft keeps its whole head")
        return None
    raise VocabularyRankingError(
        f"draft_vocab={size}: the shipped ranking ({path.name}) was made for another tokenizer (a vocabulary of "
        f"{ranking.vocab_size} tokens; this draft has {vocab_size}); use draft_vocab=0 (the whole head) or make a "
        "ranking for this tokenizer with scripts/draft_vocab_rank.py")


def restricted_draft(draft: Decoder, size: int | None, default: int, tokenizer: Tokenizer) -> Decoder:
    """``draft`` (of ``tokenizer``'s vocabulary) with its LM head restricted as ``draft_vocab_ids``
    says, or ``draft`` itself for the whole head."""
    ids = draft_vocab_ids(size, default, tokenizer, draft.config.vocab_size)
    if ids is None:
        return draft
    log.info(f"specdecode: the draft's LM head computes {ids.numel()} of {draft.config.vocab_size} tokens")
    return draft.restrict_vocabulary(ids)
