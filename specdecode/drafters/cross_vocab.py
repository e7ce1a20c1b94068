"""Cross-vocabulary drafting: a draft model with its own tokenizer proposes text, which is
translated into target tokens (e.g. SmolLM2-135M drafting for Qwen2.5).

Each ``propose``:

1. The committed target ids become text (``_CommittedText``: incremental, O(new tokens); ids that
   end inside a UTF-8 character are *pending* and left out until the character completes).
2. The text becomes draft ids (``_WindowedEncoder``: only a window at the end is re-encoded, so a
   step costs O(window), not O(context); the window is at most 512 characters). Re-tokenization
   can change the last ids (a word that grew), so the draft cache keeps the longest common prefix
   of the ids it holds and the new ones, is trimmed to it, and the rest is fed in one forward.
3. The draft drafts greedily (argmax) up to ``ceil(k * r) + 1`` draft tokens, where ``r`` is the
   draft/target token ratio of the committed text (clamped to [0.5, 2]): a finer draft
   tokenizer needs more draft tokens for the same text, and the extra one is the lookahead that
   decides whether the last target token is final (``vocab.stable_continuation``). Drafting also
   stops at the draft's end-of-sequence token and, as in ``DraftModelDrafter``, once the
   product of the draft's token probabilities falls below ``confidence`` (after one more
   lookahead token, for the same reason). On SmolLM2-135M -> Qwen2.5-Coder-1.5B (one code
   prompt, confidence 0.5) the lookahead cut target steps from 34 to 29 for 64 tokens at
   +0.9 draft forwards per step.
4. The draft text is tokenized with the target tokenizer as a continuation of the committed
   target ids (``vocab.stable_continuation``); at most ``k`` tokens are proposed.

The proposal is deterministic (``probs=None``): greedy verification keeps plain greedy output and
speculative sampling accepts each token with the target's own probability, so both stay exact
whatever the translation produces; translation quality only moves the acceptance rate.

Rollback: ``accept`` does nothing. The drafted tokens stay in the draft cache and the next
``propose`` keeps exactly the prefix of them that the committed text re-encodes to (a key/value
entry depends only on the ids up to it, so a matching prefix is valid). After an accepted draft
nothing is recomputed; after a rejection only the ids from the first difference are fed again,
in the one forward that step 2 runs anyway.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from specdecode.drafters.base import Drafter
from specdecode.sequence import EMPTY_PROPOSAL, DraftProposal, SequenceState
from specdecode.drafters.vocab import INCOMPLETE, common_prefix_len, stable_continuation
from specdecode.models.decoder import Decoder
from specdecode.sample.sampling import greedy
from specdecode.tokenizer import Tokenizer

# The draft cache holds the committed text in draft tokens, which can outnumber the target's.
CAPACITY_FACTOR = 1.5
RATIO_RANGE = (0.5, 2.0)  # clamp of the draft/target token ratio used for the draft budget
TARGET_TAIL = 8  # committed target ids re-encoded with the draft text to find the boundary
DRAFT_CONTEXT = 4  # committed draft ids decoded before the drafts (decoders that treat a start specially)


class CrossVocabDrafter(Drafter):
    """A draft model of another vocabulary, translated through text (see the module docstring)."""

    name: ClassVar[str] = "draft_model"
    draft_cost_prior: ClassVar[float] = 0.3  # a small draft model's step
    stops_by_confidence: ClassVar[bool] = True
    cross_vocabulary: ClassVar[bool] = True

    def __init__(self, draft: Decoder, draft_tokenizer: Tokenizer, target_tokenizer: Tokenizer,
                 capacity: int, confidence: float = 0.0) -> None:
        """``capacity``: the most target tokens a sequence holds; the draft cache gets
        ``CAPACITY_FACTOR`` times that (up to the draft's context). Past it, nothing is drafted."""
        self.model = draft
        self.draft_tokenizer, self.target_tokenizer = draft_tokenizer, target_tokenizer
        self.confidence = confidence
        self.cache = draft.new_cache(min(draft.max_context, math.ceil(capacity * CAPACITY_FACTOR)))
        self._limit = min(self.cache.capacity, draft.max_context)
        self._stop_ids = draft_tokenizer.eos_token_ids
        self._text = _CommittedText(target_tokenizer)
        self._encoder = _WindowedEncoder(draft_tokenizer)
        self._cached: list[int] = []  # the draft ids whose keys/values the cache holds, in order

    def begin(self, seq: SequenceState) -> None:
        self.cache.reset()
        self._cached = []
        self._text.reset()
        self._encoder.reset()

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        if k <= 0:
            return EMPTY_PROPOSAL
        if self._text.update(seq.token_ids):  # text before the encoder's window changed
            self._encoder.reset()
        context = self._encoder.encode(self._text.text)
        budget = self._budget(k, len(context))
        if budget <= 0:
            return EMPTY_PROPOSAL
        drafted, ended = self._draft(self._sync(context), budget)
        tokens = self._translate(seq.token_ids, context, drafted, ended)[:k]
        return DraftProposal(torch.tensor(tokens, dtype=torch.long), None)

    def accept(self, seq: SequenceState, n_accepted: int) -> None:
        """Nothing to undo: the next ``propose`` keeps the cached ids that the committed text
        re-encodes to and trims the rest (see the module docstring)."""

    def _budget(self, k: int, n_context: int) -> int:
        """Draft tokens for ``k`` target tokens, within the draft cache (drafts but the last are fed)."""
        if n_context == 0:
            return 0
        low, high = RATIO_RANGE
        ratio = min(high, max(low, n_context / max(1, self._text.clean)))
        return min(math.ceil(k * ratio) + 1, self._limit - n_context + 1)

    def _sync(self, context: list[int]) -> Tensor:
        """Make the cache hold ``context``; return the draft's logits [1, V] after it."""
        keep = min(common_prefix_len(self._cached, context), len(context) - 1)  # feed >= 1 id
        self.cache.trim(self.cache.length - keep)
        logits = self.model.forward(torch.tensor(context[keep:], dtype=torch.long), self.cache, last_only=True)
        self._cached = list(context)
        return logits

    def _draft(self, logits: Tensor, budget: int) -> tuple[list[int], bool]:
        """Greedy draft ids, and whether the draft ended with its end-of-sequence token.

        When the running confidence falls below ``confidence`` one more token is drafted: the
        translation keeps only target tokens that one more draft token does not change, so
        without it the last confident token would be lost (the same-vocabulary drafter proposes
        its last token too)."""
        drafted: list[int] = []
        cumulative, limit = 1.0, budget
        while True:
            token = greedy(logits)  # [1]
            drafted.append(int(token[0]))
            if drafted[-1] in self._stop_ids:
                return drafted, True
            if self.confidence > 0:
                cumulative *= float(torch.softmax(logits[0], -1)[drafted[-1]])
                if cumulative < self.confidence:
                    limit = min(limit, len(drafted) + 1)
            if len(drafted) >= limit:
                return drafted, False
            logits = self.model.forward(token, self.cache)
            self._cached.append(drafted[-1])

    def _translate(self, committed: Sequence[int], context: list[int], drafted: list[int], ended: bool) -> list[int]:
        """Target ids continuing ``committed`` with the draft's text (see ``vocab.py``)."""
        eos = drafted.pop() if ended else None
        window = context[-DRAFT_CONTEXT:]
        decode = self.draft_tokenizer.decode
        base = decode(window, skip_special_tokens=False)
        texts = []
        for i in range(1, len(drafted) + 1):
            text = decode(window + drafted[:i], skip_special_tokens=False)
            texts.append(text[len(base):] if text.startswith(base) else decode(drafted[:i], skip_special_tokens=False))
        clean = self._text.clean
        start = max(0, clean - TARGET_TAIL)
        tokens = stable_continuation(self.target_tokenizer, committed[start:], len(committed) - clean, texts, ended)
        spelled = not texts or (bool(tokens) and INCOMPLETE not in texts[-1])  # the whole text, as it ended
        if eos is not None and spelled:
            target_eos = self.target_tokenizer.token_to_id(decode([eos], skip_special_tokens=False))
            tokens += [target_eos] if target_eos is not None else []
        return tokens


class _CommittedText:
    """The text of the committed target ids, decoded incrementally (O(new ids) per update).

    ``clean`` ids spell ``text``; the ids after them end inside a UTF-8 character (at most
    ``MAX_PENDING`` of them) and wait for the rest of it. Special tokens are kept as text so the
    draft sees the chat structure (its tokenizer maps e.g. ``<|im_start|>`` to its own id).
    """

    CONTEXT = 4  # ids decoded before the new ones: some decoders treat a string's start specially
    MAX_PENDING = 3  # an incomplete character has at most 3 bytes, so at most 3 ids

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.reset()

    def reset(self) -> None:
        self.text = ""
        self.clean = 0

    def update(self, ids: Sequence[int]) -> bool:
        """Take the ids added since the last call; True when earlier text changed (a U+FFFD
        taken as final became part of a character) and ``text`` was decoded again in full."""
        restarted = len(ids) < self.clean  # not the sequence seen so far
        if restarted:
            self.reset()
        start = max(0, self.clean - self.CONTEXT)
        before = self._decode(ids[start:self.clean])
        end = len(ids)
        for cut in range(len(ids), max(self.clean, len(ids) - self.MAX_PENDING) - 1, -1):
            if not self._decode(ids[start:cut]).endswith(INCOMPLETE):
                end = cut
                break
        window = self._decode(ids[start:end])
        self.clean = end
        if window.startswith(before):
            self.text += window[len(before):]
            return restarted
        self.text = self._decode(ids[:end])
        return True

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False) if ids else ""


class _WindowedEncoder:
    """Draft ids of a text that grows at its end, re-encoding only a window at the end.

    The window starts at an anchor: a token boundary at least ``MARGIN`` characters before the
    end of an earlier text, checked to be one where encoding restarts identically (the ids after
    it equal the encoding of the text after it). Text before the anchor is never re-encoded, so
    the ids equal a full encoding unless a single pre-token spans more than ``MARGIN`` characters
    (then they are a valid but non-canonical tokenization, which only affects the draft's
    guesses). Tokenizers whose decode does not give back the encoded text (e.g. a normalizer
    changed it) never move the anchor and fall back to full encodes.
    """

    WINDOW = 512  # characters re-encoded before the anchor moves
    MARGIN = 128  # characters kept after a new anchor

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.reset()

    def reset(self) -> None:
        self._ids: list[int] = []
        self._anchor_chars = 0
        self._anchor_ids = 0

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, which must extend the texts passed since the last ``reset``."""
        tail = text[self._anchor_chars:]
        tail_ids = self._tokenizer.encode(tail)
        self._ids = self._ids[: self._anchor_ids] + tail_ids
        if len(tail) > self.WINDOW:
            self._advance(tail, tail_ids)
        return self._ids

    def _advance(self, tail: str, tail_ids: list[int]) -> None:
        guess = len(tail_ids) * (len(tail) - self.MARGIN) // len(tail)
        for j in range(guess, max(0, guess - 4), -1):
            head = self._tokenizer.decode(tail_ids[:j], skip_special_tokens=False)
            if (len(tail) - len(head) >= self.MARGIN and tail.startswith(head) and not head.endswith(INCOMPLETE)
                    and self._tokenizer.encode(tail[len(head):]) == tail_ids[j:]):
                self._anchor_chars += len(head)
                self._anchor_ids += j
                return
