"""Vocabularies: whether a draft shares the target's token ids, and translating draft text into
target ids when it does not. Pure functions over a :class:`Tokenizer`.

Translation is text-based: a draft of another vocabulary proposes *text*, and the target's
proposal is the target tokenization of that text as a continuation of the committed target ids.
Two things can make that tokenization differ from what the target would emit, and both are
handled here rather than assumed away:

- the boundary: the committed tokens' text followed by the draft text may tokenize with a merge
  across the boundary (committed ``Ġfoo`` + draft ``bar`` encodes as ``Ġfoobar``), so the
  committed ids are not a prefix of the encoding. Then a shorter committed context is tried,
  down to the draft text alone (``continue_ids``).
- the end: the draft text stops at an arbitrary point, so its last target token could still
  grow (``retu`` -> ``return``) or the last word could re-tokenize. Only tokens that do not
  change when the draft's last token is added are kept (``stable_continuation``).

Correctness never depends on any of this (the target verifies every proposed token); only the
acceptance rate does.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.tokenizer import Tokenizer

INCOMPLETE = "\ufffd"  # what a decoder yields for bytes that are not (yet) a whole UTF-8 character


def same_vocabulary(target_tok: Tokenizer, draft_tok: Tokenizer, target_vocab_size: int,
                    draft_vocab_size: int) -> bool:
    """True when the draft's token ids mean what the target's do, so drafts can be verified
    as ids (the same-vocabulary path).

    Models must have the same number of logits, and every token of the target tokenizer
    (added tokens included) must have the same id in the draft tokenizer. Extra draft-only
    tokens are allowed: the target never emits them and verification rejects them. Costs one
    dict comparison over the vocabulary (~0.3 s for 150k tokens), once per model pair.
    """
    if target_vocab_size != draft_vocab_size:
        return False
    target_vocab = target_tok.backend.get_vocab(with_added_tokens=True)
    draft_vocab = draft_tok.backend.get_vocab(with_added_tokens=True)
    if len(target_vocab) > len(draft_vocab):
        return False
    return all(draft_vocab.get(token) == index for token, index in target_vocab.items())


def clean_prefix(text: str) -> str:
    """``text`` up to its first U+FFFD: a partial UTF-8 character at the end of a draft (its last
    byte tokens), or bytes the draft got wrong, are not text the target can be asked to spell."""
    cut = text.find(INCOMPLETE)
    return text if cut < 0 else text[:cut]


def continue_ids(tokenizer: Tokenizer, tail_ids: Sequence[int], n_pending: int, text: str) -> list[int] | None:
    """Target ids that continue ``tail_ids`` (the last committed target ids) with ``text``.

    ``text`` continues the *clean* text of the tail: that of ``tail_ids`` without its last
    ``n_pending`` ids, which spell an incomplete UTF-8 character (its remaining bytes start
    ``text``). The encoding of (tail text + ``text``) is used when it reproduces the tail ids;
    otherwise the tail is shortened from the left (its first tokens may be a non-canonical
    tokenization) down to the pending ids alone (``text`` encoded on its own). None when even
    that fails, i.e. the pending bytes are not the canonical start of ``text``'s first character.
    """
    tail_ids = list(tail_ids)
    clean_end = len(tail_ids) - n_pending
    for start in range(clean_end + 1):  # the longest context first: it keeps boundary effects
        context = tokenizer.decode(tail_ids[start:clean_end], skip_special_tokens=False)
        if context.startswith(INCOMPLETE):  # the context starts inside a character
            continue
        ids = tokenizer.encode(context + text)
        fixed = tail_ids[start:]
        if ids[: len(fixed)] == fixed:
            return ids[len(fixed):]
    return None


def stable_continuation(tokenizer: Tokenizer, tail_ids: Sequence[int], n_pending: int,
                        texts: Sequence[str], complete: bool) -> list[int]:
    """The target ids for the last of ``texts`` that will not change as the draft goes on.

    ``texts``: the draft text after each draft token (each a prefix of the next, the last is
    the whole draft). ``complete``: the draft ended on purpose (end of sequence), so the last
    token is final too. Otherwise the kept ids are the common prefix of the translations of the
    whole text and of the longest shorter clean text: tokens that survive one more draft token
    (a word still being spelled or a merge still pending is dropped). Empty when nothing is
    certain, e.g. a single draft token.
    """
    if not texts:
        return []
    whole = clean_prefix(texts[-1])
    complete = complete and whole == texts[-1]  # a cut-off character is not an ending
    full = continue_ids(tokenizer, tail_ids, n_pending, whole) if whole or complete else []
    if not full or complete:
        return full or []
    shorter = next((t for t in map(clean_prefix, reversed(texts[:-1])) if len(t) < len(whole)), "")
    short = continue_ids(tokenizer, tail_ids, n_pending, shorter) if shorter else []
    return full[: common_prefix_len(full, short or [])]


def common_prefix_len(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, given that the first ``start`` agree."""
    n = start
    for x, y in zip(a[start:], b[start:]):
        if x != y:
            break
        n += 1
    return n
