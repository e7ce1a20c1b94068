"""Structured output: a grammar decides which tokens the target may emit, at every position.

The engine is llguidance (why it and not xgrammar or outlines-core: docs/SERVING.md, "Structured
output"): it reads our ``tokenizer.json`` as it is, keeps special tokens out of matched text, and
has the calls speculation needs: ``try_consume_tokens`` and ``rollback`` test drafts, and
``compute_ff_tokens`` gives the tokens the grammar forces. A grammar that cannot roll back
(llguidance's ``max_tokens=``/``stop=`` lexemes) is refused when it is checked.

How a step stays exact. The reference is plain constrained decoding: at each position the target's
logits are masked to the tokens the grammar allows, then the request's rule picks (argmax, or a
sample of the masked distribution). In a verify step:

1. ``prune`` cuts the drafts the grammar rejects before the forward. A draft chosen without
   randomness (greedy, n-gram, trees, forced tokens) would be rejected anyway (its masked
   probability is 0, and so is the mass the rejection rule would remove), so cutting it changes
   nothing. A draft *sampled* from a distribution q is kept as the chain's last draft instead:
   it is rejected for sure, and the token then comes from the residual max(0, p - q), which a
   cut would replace by a sample of p, moving the law by the mass q put on forbidden tokens;
2. ``row_masks`` gives each verify row the mask of its own position (the state after the drafts
   before it; the bonus row included), applied to the logits before the acceptance rule, which
   then sees exactly the constrained target;
3. ``advance`` moves the grammar by the tokens committed.

Tokens the grammar forces (``forced``) become the step's drafts without running the drafter; they
are verified like any draft, so a grammar that allows another tokenization still leaves the choice
to the target. A draft model follows the grammar too (``mask_after``): it drafts from its own
masked distribution, which is the ``q`` the rejection rule is given, so its drafts are never cut
and the rule stays exact.

End of sequence: a drafted EOS is kept only if the grammar accepts there, and ends the drafts (the
request stops at it). EOS is never fed to the matcher while computing masks, since llguidance does
not record an EOS after the grammar has stopped and a later rollback would undo one token too many.
"""

from __future__ import annotations

import json
import threading

import torch
from torch import Tensor

from specdecode.params import Constraint
from specdecode.sequence import DraftProposal
from specdecode.errors import InvalidConstraintError
from specdecode.tokenizer import Tokenizer

_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)
CHECK_TOKENS = 32  # first tokens a check consumes (spread over those allowed) to find a grammar beyond its limits
MAX_CHOICES = 2000  # llguidance's items per parser row: a longer list fails at its first token
MAX_SPEC_CHARS = 256 * 1024  # a constraint's text: its compile time grows with it, before the request is queued
MESSAGE_CHARS = 300  # most of a grammar engine's message passed on in an error
_GRAMMAR_CACHE = 256  # compiled grammar texts kept per compiler (a server sees the same schemas again)
# JSON as ``json.dumps`` writes it: no free whitespace, which a model could otherwise emit until
# max_tokens (vLLM's ``disable_any_whitespace``), and the separators models are trained on.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    """Compiles constraints for one tokenizer, from any thread. Building llguidance's tokenizer
    takes about a second for a 150k vocabulary, so it is built once, on the first constraint;
    each constraint's grammar text is kept, so a server's check and its request share the work."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._grammars: dict[Constraint, str] = {}

    @property
    def ll_tokenizer(self):  # noqa: ANN201 - llguidance.LLTokenizer, imported lazily
        with self._lock:
            if self._ll_tokenizer is None:
                from llguidance import LLTokenizer

                self._ll_tokenizer = LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=sorted(self.tokenizer.eos_token_ids))
            return self._ll_tokenizer

    def grammar(self, constraint: Constraint) -> str:
        """The llguidance grammar of ``constraint``; raises InvalidConstraintError if it does not compile."""
        from llguidance import LLMatcher

        with self._lock:
            known = self._grammars.get(constraint)
        if known is not None:
            return known
        if len(constraint.spec) > MAX_SPEC_CHARS:
            raise InvalidConstraintError(f"the {constraint.kind} constraint is {len(constraint.spec)} characters long; "
                                         f"at most {MAX_SPEC_CHARS} are compiled")
        try:
            grammar = _grammar_text(constraint, LLMatcher)
        except (ValueError, TypeError, RecursionError) as exc:
            raise InvalidConstraintError(f"the {constraint.kind} constraint is not valid: {exc}") from None
        problem = LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if problem:
            raise InvalidConstraintError(f"the {constraint.kind} constraint is not valid: {_first_line(problem)}")
        with self._lock:
            if len(self._grammars) >= _GRAMMAR_CACHE:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[constraint] = grammar
        return grammar

    def check(self, constraint: Constraint) -> None:
        """Raise InvalidConstraintError now, so a server answers 400 before queueing the request:
        the grammar compiles, its matcher starts, allows some output, runs within the grammar
        engine's limits on up to ``CHECK_TOKENS`` of its first tokens (a list of thousands of
        choices sharing a first digit passes llguidance's items-per-row limit only there), and
        can roll each back (speculation undoes drafts; llguidance cannot for grammars with
        ``max_tokens=`` or ``stop=`` lexemes). Each refusal says which of these failed."""
        grammar, kind = self.matcher(constraint), constraint.kind
        allowed = grammar.mask().nonzero().flatten().tolist()
        if not allowed:
            raise InvalidConstraintError(f"the {kind} constraint allows no output at all")
        firsts = [t for t in allowed if t not in grammar.eos_ids]
        matcher = grammar.matcher
        for token in firsts[:: max(1, -(-len(firsts) // CHECK_TOKENS))]:
            if not matcher.consume_tokens([token]) or matcher.is_error():
                raise InvalidConstraintError(f"the {kind} constraint is beyond the grammar engine's limits: "
                                             f"{_first_line(matcher.get_error())}")
            if not matcher.rollback(1):
                raise InvalidConstraintError(f"the {kind} constraint cannot be used with speculative decoding: "
                                             "its grammar cannot undo a token (drop max_tokens= or stop= from "
                                             "its lexemes)")

    def matcher(self, constraint: Constraint) -> TokenGrammar:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.ll_tokenizer, self.grammar(constraint), log_level=0)
        if matcher.is_error():
            raise InvalidConstraintError(f"the {constraint.kind} constraint is not valid: "
                                         f"{_first_line(matcher.get_error())}")
        return TokenGrammar(matcher, self.tokenizer.eos_token_ids, self.vocab_size)


class TokenGrammar:
    """One request's grammar state: the tokens committed so far, and masks for what may follow.

    A step asks for the same masks several times (the draft model drafting, ``prune``,
    ``row_masks``) and for the forced tokens twice (``draft_budget`` and ``plan``); each is a pass
    over the vocabulary, so they are kept, masks keyed by the drafts after the committed tokens,
    until ``advance`` moves the state."""

    def __init__(self, matcher, eos_ids: frozenset[int], vocab_size: int) -> None:  # noqa: ANN001
        self.matcher, self.eos_ids, self.vocab_size = matcher, eos_ids, vocab_size
        self._masks: dict[tuple[int, ...], Tensor | None] = {}
        self._forced: list[int] | None = None

    def mask(self) -> Tensor:
        """[V] bool: the tokens allowed next."""
        mask = self._mask_at(())
        assert mask is not None  # the empty path is always valid
        return mask

    def mask_after(self, drafts: list[int]) -> Tensor:
        """[V] bool: the tokens allowed after ``drafts`` (grammar-valid, no EOS), for a drafter
        that follows the grammar; the state is left where it was."""
        mask = self._mask_at(tuple(drafts))
        if mask is None:
            raise RuntimeError(f"drafts {drafts[:8]} broke the grammar")
        return mask

    def forced(self) -> list[int]:
        """Tokens the grammar allows alone from here (e.g. ``{"`` then a required key)."""
        if self._forced is None:
            self._forced = list(self.matcher.compute_ff_tokens())
        return self._forced

    def prune(self, proposal: DraftProposal) -> DraftProposal:
        """``proposal`` without the drafts the grammar rejects (a chain keeps its valid prefix; a
        tree keeps the nodes whose whole path is valid)."""
        if not proposal.k:
            return proposal
        tokens = proposal.tokens.tolist()
        if proposal.parents is None:
            n = 0
            while n < proposal.k and self._allows(tokens[:n], tokens[n]):
                n += 1
                if tokens[n - 1] in self.eos_ids:  # the request ends there
                    break
            sampled = proposal.probs is not None  # keep its first invalid draft: see the module docstring
            return proposal.truncated(n + 1 if sampled and n < proposal.k else n)
        keep: list[int] = []
        for i, parent in enumerate(proposal.parents):
            if parent >= 0 and (parent not in keep or tokens[parent] in self.eos_ids):
                continue
            path = _path(tokens, proposal.parents, i)
            if self._allows(path[:-1], path[-1]):
                keep.append(i)
        return proposal.kept(keep)

    def row_masks(self, proposal: DraftProposal) -> Tensor:
        """[K + 1, V] bool: verify row r's allowed tokens (row 0 the last committed token's, row
        i + 1 draft i's), for drafts that passed ``prune``. A row after a drafted EOS, or after
        a sampled draft the grammar forbids (kept by ``prune``, rejected for sure), allows
        everything: its token is never committed."""
        tokens = proposal.tokens.tolist()
        parents = proposal.parents if proposal.parents is not None else tuple(range(-1, proposal.k - 1))
        rows = [self.mask()]
        for i in range(proposal.k):
            path = _path(tokens, parents, i)
            mask = None if path[-1] in self.eos_ids else self._mask_at(tuple(path))
            rows.append(torch.ones(self.vocab_size, dtype=torch.bool) if mask is None else mask)
        return torch.stack(rows)

    def advance(self, tokens: list[int]) -> None:
        """Commit ``tokens`` (each one the masks allowed)."""
        if tokens:
            self._masks.clear()
            self._forced = None
            if not self.matcher.consume_tokens(tokens):  # the masks allowed them: a grammar engine's limit
                raise InvalidConstraintError(f"the constraint went beyond the grammar engine's limits: "
                                             f"{_first_line(self.matcher.get_error())}")

    def _allows(self, drafts: list[int], token: int) -> bool:
        """Whether ``token`` may follow the committed tokens and ``drafts`` (which contain no EOS)."""
        mask = self._mask_at(tuple(drafts))
        return mask is not None and bool(mask[token])

    def _mask_at(self, drafts: tuple[int, ...]) -> Tensor | None:
        """[V] bool after ``drafts`` (no EOS among them), or None if the grammar rejects them. A
        grammar that failed on the way (a parser limit) is an error for the request, never a
        silent end of sequence."""
        if drafts not in self._masks:
            n = self.matcher.try_consume_tokens(list(drafts))
            mask = None
            if n == len(drafts):
                bitmask = self.matcher.compute_bitmask()
                if self.matcher.is_error():
                    raise InvalidConstraintError(f"the grammar failed: {_first_line(self.matcher.get_error())}")
                mask = _unpack(bitmask, self.vocab_size)
            if n and not self.matcher.rollback(n):
                raise InvalidConstraintError(f"the grammar could not undo {n} tokens: "
                                             f"{_first_line(self.matcher.get_error())}")
            self._masks[drafts] = mask
        return self._masks[drafts]


def apply_mask(logits: Tensor, allowed: Tensor) -> Tensor:
    """logits [N, V], allowed [N, V] bool -> the logits with forbidden tokens at -inf."""
    return logits.masked_fill(~allowed, float("-inf"))


def _grammar_text(constraint: Constraint, matcher_cls) -> str:  # noqa: ANN001
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_object":
        return matcher_cls.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "json_schema":
        schema = json.loads(spec)
        if schema is True:  # JSON Schema's "anything"
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return matcher_cls.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    if kind == "regex":
        return matcher_cls.grammar_from_regex(spec)
    if kind == "choice":
        options = json.loads(spec)
        if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
            raise ValueError("choice takes a non-empty list of strings")
        if len(options) > MAX_CHOICES:
            raise ValueError(f"choice takes at most {MAX_CHOICES} options (the grammar engine's limit on "
                             f"alternatives in a row), got {len(options)}")
        return matcher_cls.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    return matcher_cls.grammar_from_lark(spec)


def _path(tokens: list[int], parents: tuple[int, ...], i: int) -> list[int]:
    """Draft i's tokens from the root: its ancestors, then itself."""
    path = []
    while i >= 0:
        path.append(tokens[i])
        i = parents[i]
    return path[::-1]


def _unpack(bitmask: bytes, vocab_size: int) -> Tensor:
    """llguidance's bitmask (bit j of little-endian word w: token 32w + j) -> [V] bool."""
    raw = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)
    return ((raw.unsqueeze(-1) >> _BIT_SHIFTS) & 1).bool().flatten()[:vocab_size]


def _first_line(message: str) -> str:
    """The first line of a grammar engine's message, at most ``MESSAGE_CHARS``: its messages can
    carry the parser's state and the user's grammar, which no error or log line should."""
    line = message.strip().splitlines()[0] if message.strip() else message
    return line if len(line) <= MESSAGE_CHARS else line[:MESSAGE_CHARS] + " ..."
