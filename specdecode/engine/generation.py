"""The propose -> verify -> commit loop.

Reads like the papers: the drafter proposes K tokens, the target scores the last committed token
plus the K drafts in one forward, an exact acceptance rule keeps a prefix and supplies one more
token, and the target's cache is trimmed back to the kept tokens. ``none`` is the same loop with
K = 0, so plain decoding and speculative decoding share every line of the target path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdecode.sample.grammar import TokenGrammar, apply_mask
from specdecode.sample.logprobs import TokenLogprob, token_logprobs
from specdecode.sample.penalties import TokenCounts
from specdecode.sample.synthetic import verify_synthetic
from specdecode.sample.verify import verify
from specdecode.models.cache import KVCache
from specdecode.config import SpecConfig
from specdecode.params import MAX_SPECULATIVE_TOKENS, SamplingParams
from specdecode.engine.costs import RequestSpeculation
from specdecode.drafters.base import Drafter, DraftSource
from specdecode.drafters.prediction import SOURCE as PREDICTION, Prediction
from specdecode.sequence import EMPTY_PROPOSAL, DraftProposal, SequenceState
from specdecode.errors import NonFiniteLogitsError
from specdecode.models.decoder import HiddenCapture
from specdecode.sample.race import RaceKeys, race
from specdecode.sample.sampling import greedy, logits_to_probs
from specdecode.engine.stats import RequestStats
from specdecode.engine.stops import StopChecker
from specdecode.tokenizer import Tokenizer


@dataclass(slots=True)
class GenerationOutput:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_token_ids: list[int]
    method: str
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked


# Prompt tokens per prefill forward. A server runs other requests' decode steps between chunks, so
# a long prompt stalls them for one chunk rather than for its whole prefill (docs/SERVING.md, "Long
# prompts"); 256 rows keep the kernels at full speed.
PREFILL_CHUNK = 256

@dataclass(frozen=True, slots=True)
class StreamEvent:
    text: str  # newly final text (never retracted)
    token_ids: list[int]  # tokens committed in this step
    output: GenerationOutput | None = None  # set on the last event
    logprobs: list[TokenLogprob] = field(default_factory=list)  # token_ids' logprobs, when asked


class Generation:
    """One request's decoding state, advanced one target forward at a time.

    The step loop (``batch.py``) drives it: run the target on each of ``prefill_chunks()`` in
    turn, pass the last one's logits to ``start``; then, until ``finished``, draft (when
    ``drafts``), run the target on ``plan(proposal)`` (the last committed token plus this step's
    drafts) and pass the logits to ``commit``; then ``finish`` returns the last event. The loop
    decides whether a forward is shared with other requests; the token decisions here never
    depend on it.

    Each verify row's logits are processed before any token is chosen from them: penalties and
    logit bias first (with the counts of the tokens before that row: ``sample/penalties.py``),
    then the grammar mask. The acceptance rule, the drafter's ``observe`` and the reported
    logprobs all see the processed logits, the distribution the request asked to sample from.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter | None, spec: SpecConfig,
                 tokenizer: Tokenizer, cache: KVCache, max_seq_len: int, grammar: TokenGrammar | None = None,
                 cached: int = 0) -> None:
        """``cached``: how many leading prompt tokens ``cache`` already holds (a prefix cache
        hit, ``models/prefix_cache.py``); the prefill runs the rest."""
        self.started = time.perf_counter()
        self.cache, self.drafter, self.max_seq_len = cache, drafter, max_seq_len
        if not 0 <= cached < len(prompt_ids):
            raise ValueError(f"{cached} cached tokens of a {len(prompt_ids)}-token prompt: at least one must run")
        self.cached = cached
        self.stats = RequestStats(prompt_tokens=len(prompt_ids), cached_tokens=cached)
        seed = params.seed if params.seed is not None else torch.seed()
        keys = None if params.greedy else RaceKeys(seed)  # sampled tokens: races keyed by position
        self.seq = SequenceState(list(prompt_ids), len(prompt_ids), params, torch.Generator().manual_seed(seed),
                                 grammar, keys)
        self.k_max = spec.num_speculative_tokens
        # The policy chooses K unless told not to, or the drafter sizes its own proposals (a
        # lookahead window's depth is not a draft length).
        self.adaptive = spec.adaptive and (drafter is None or drafter.adapts_length)
        # What the speculation policy learns of this request, per draft source (``DraftSource.name``).
        self.speculation: dict[str, RequestSpeculation] = {}
        self.stops = StopChecker(tokenizer, params)
        self.synthetic = spec.synthetic_acceptance  # None: the exact rules (see sample/synthetic.py)
        self.proposal = EMPTY_PROPOSAL
        self.grammar = grammar  # structured output: masks every position (sample/grammar.py)
        # penalties and logit bias: their token counts (None: the request sets neither)
        self.counts = TokenCounts(prompt_ids, params) if params.penalised else None
        self.forced_step = False  # this step's drafts are tokens the grammar forced, not the drafter's
        self.pruned = False  # the grammar cut some of this step's drafts
        self.accepted = 0  # drafts the last step kept
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # What every target forward of this request captures for the drafter (None: nothing).
        self.capture = (HiddenCapture(drafter.hidden_layers)
                        if drafter is not None and drafter.needs_hidden_states else None)
        # The client's predicted output: a free draft source offered before the drafter's.
        predicted = params.prediction
        self.prediction = (Prediction(tokenizer.encode(predicted) if isinstance(predicted, str) else list(predicted))
                           if predicted else None)
        self.foreign_step = False  # this step's drafts came from the prediction, not the drafter
        cache.length = cached

    @property
    def finished(self) -> bool:
        return self.stops.finished

    def prefill_chunks(self) -> list[Tensor]:
        """The prompt's tokens after the cached ones, in forwards of at most ``PREFILL_CHUNK``
        tokens, to run in order.

        The step loop runs them on the target's row-invariant kernels, so where the chunks start
        and end never changes a bit; chunking lets a server run other requests' decode steps, or
        notice a cancelled request, between one chunk and the next.
        """
        ids = self.seq.token_ids
        return [torch.tensor(ids[s : s + PREFILL_CHUNK]) for s in range(self.cached, len(ids), PREFILL_CHUNK)]

    def start(self, logits: Tensor) -> StreamEvent:
        """Take the prefill's last-row logits [1, V]: pick the first token, start the drafter."""
        _check_finite(logits)
        self.stats.prefill_s = time.perf_counter() - self.started
        logits = self._processed(logits, EMPTY_PROPOSAL)
        new = self.stops.push(self.seq, [_pick(logits, self.seq)])
        self.stats.ttft_s = time.perf_counter() - self.started
        if self.drafter is not None and not self.finished:
            self.drafter.begin(self.seq)
            if self.capture is not None:
                self.drafter.observe_hidden(self.capture.take())
        return self._event(new, logits)

    def can_start_on(self, other: Generation) -> bool:
        """Whether this request can start on ``other``'s prefill (``start_shared``): the same
        prompt, none of it in this request's cache yet, and where this request's drafter reads
        the prompt's hidden states, ``other``'s prefill captures the same layers over all of it."""
        n = self.seq.prompt_len
        if self.cached or other.seq.prompt_len != n or other.seq.token_ids[:n] != self.seq.token_ids[:n]:
            return False
        return self.capture is None or (other.capture is not None and other.capture.layers == self.capture.layers
                                        and other.cached == 0)

    def start_shared(self, source: KVCache, logits: Tensor, hidden: HiddenCapture | None = None) -> StreamEvent:
        """``start`` on another request's prefill of the same prompt (another sample of it):
        ``source`` holds the prompt's keys and values, ``logits`` [1, V] are its last row, and
        ``hidden`` the prompt's hidden states that prefill captured, for a drafter that reads them.
        The prefill runs on row-invariant kernels, so these are the bits this request's own
        prefill would compute; copying them replaces that prefill."""
        if self.cached:
            raise ValueError("start_shared needs a request whose cache holds none of the prompt")
        if self.capture is not None:
            if hidden is None:
                raise ValueError("this request's drafter reads hidden states: start_shared needs the prefill's")
            hidden.copy_to(self.capture)
        n = self.seq.prompt_len
        self.cache.copy_prefix(source, n)
        self.cached = self.stats.cached_tokens = n
        return self.start(logits)

    def _processed(self, logits: Tensor, proposal: DraftProposal) -> Tensor:
        """The verify rows [K + 1, V] of ``proposal`` (the first token's row: the empty proposal)
        with penalties and logit bias applied, each row counting the output and the drafts on its
        path, then the grammar's mask of that row's position."""
        if self.counts is not None:
            self.counts.count(self.seq.token_ids, self.seq.prompt_len)
            logits = self.counts.apply(logits, proposal.row_paths())
        if self.grammar is not None:
            logits = apply_mask(logits, self.grammar.row_masks(proposal))
        return logits

    def _event(self, new: list[int], rows: Tensor) -> StreamEvent:
        """The step's event for the committed tokens ``new``, chosen on ``rows`` (one per token);
        moves the grammar past them and records their logprobs."""
        if self.grammar is not None and not self.finished:
            self.grammar.advance(new)
        logprobs = []
        if self.logprobs is not None:
            logprobs = token_logprobs(rows, new, self.seq.params.logprobs or 0)
            self.logprobs += logprobs
        return StreamEvent(self.stops.take_text(), new, logprobs=logprobs)

    def speculation_for(self, source: str) -> RequestSpeculation:
        """What the policy learned of this request's drafts from ``source``."""
        return self.speculation.setdefault(source, RequestSpeculation())

    @property
    def drafts(self) -> bool:
        """Whether this request may draft this step: it has a drafter or a prediction, there is
        room for a draft, and the grammar forces none (forced drafts need no drafter)."""
        return ((self.drafter is not None or self.prediction is not None) and self.draft_room() > 0
                and not self.forced_drafts().k)

    def sources(self) -> tuple[DraftSource, ...]:
        """What this request can draft from this step: its prediction where the output has a
        place in it, then its drafter's sources."""
        own = self.drafter.sources(self.seq) if self.drafter is not None else ()
        predicted = self.prediction.source(self.seq) if self.prediction is not None else None
        return own if predicted is None else (predicted, *own)

    def draft_from(self, source: DraftSource) -> None:
        """Note which source drafts this step: the drafter is told of drafts it did not make."""
        self.foreign_step = source.name == PREDICTION

    def draft_room(self) -> int:
        """The most drafts this step can carry: drafts plus the one token every step adds must fit
        ``max_tokens`` and the context, as in plain decoding."""
        seq, params = self.seq, self.seq.params
        return max(0, min(params.max_tokens - seq.num_generated - 1, self.max_seq_len - len(seq.token_ids) - 1))

    def forced_drafts(self) -> DraftProposal:
        """The tokens the grammar forces next (as many as fit), as a chain of point-mass drafts:
        kept for sure and drafted at no cost, so they ride along whatever K the policy chose."""
        room = self.draft_room()
        if self.grammar is None or not room:
            return EMPTY_PROPOSAL
        forced = self.grammar.forced()[:room]
        return DraftProposal(torch.tensor(forced, dtype=torch.long), None) if forced else EMPTY_PROPOSAL

    def plan(self, proposal: DraftProposal = EMPTY_PROPOSAL, draft_s: float = 0.0) -> Tensor | None:
        """The verify inputs (last token + this step's drafts), or None when the context is full
        (the request then finishes with ``length``).

        ``proposal``: the drafter's drafts for this step (the step loop drafts for every request
        at once), taking ``draft_s``; tokens the grammar forces replace them.
        """
        seq = self.seq
        self.stats.draft_s += draft_s
        if len(seq.token_ids) >= self.max_seq_len:
            self.stops.mark_length()
            return None
        forced = self.forced_drafts()
        self.forced_step = bool(forced.k)
        if forced.k:  # the grammar's own drafts: the drafter sat this step out
            proposal = forced
        self.pruned = False
        if self.grammar is not None:
            drafted, proposal = proposal.k, self.grammar.prune(proposal)
            self.pruned = proposal.k < drafted
        # A tree may hold more nodes than its depth: keep it within the cache and the widest
        # verify call the invariant kernels serve.
        room = min(MAX_SPECULATIVE_TOKENS, self.cache.capacity - self.cache.length - 1)
        self.proposal = proposal.truncated(room)
        return torch.cat([torch.tensor(seq.token_ids[-1:]), self.proposal.tokens])

    @property
    def tree(self) -> list[int] | None:
        """The verify rows' parent rows when this step's drafts form a tree (None for a chain)."""
        if not self.proposal.is_tree:
            return None
        return [-1] + [p + 1 for p in self.proposal.parents]

    def commit(self, logits: Tensor, forward_s: float = 0.0) -> StreamEvent:
        """Take the verify logits [K+1, V]: keep the valid draft prefix and one more token, trim
        the rejected drafts from the cache, tell the drafter. ``forward_s``: the forward's time."""
        _check_finite(logits)
        seq, proposal, stats = self.seq, self.proposal, self.stats
        logits = self._processed(logits, proposal)
        if self.synthetic is not None and proposal.k:
            result = verify_synthetic(proposal, logits, seq.params, self.synthetic, seq.generator)
        else:
            result = verify(proposal, logits, seq.params, _row_keys(seq, proposal, logits.shape[-1]))
        self.cache.commit(result, proposal.k + 1)
        stats.verify_s += forward_s
        stats.target_steps += 1
        self.accepted = result.num_accepted
        if proposal.k and not self.forced_step:  # the drafter's acceptance, not the grammar's
            stats.record_draft(proposal.k, result.num_accepted, proposal.depth)
            if self.foreign_step:
                stats.prediction_accepted += result.num_accepted
                stats.prediction_rejected += proposal.k - result.num_accepted
        elif not proposal.k:
            stats.plain_steps += 1
        new = self.stops.push(seq, result.tokens)
        if seq.keys is not None:
            seq.keys.forget_before(len(seq.token_ids))
        kept = result.rows if result.rows is not None else list(range(result.num_accepted + 1))
        if self.drafter is not None and not self.finished:
            t0 = time.perf_counter()
            own = not (self.forced_step or self.foreign_step)  # the drafter made this step's drafts
            if own and not self.pruned:  # rows as the drafter proposed them
                self.drafter.observe(logits)
            if self.capture is not None:
                self.drafter.observe_hidden(self.capture.take()[kept])
            # After a forced or predicted step the drafter kept none of its own drafts (it made
            # none) and catches up on the committed tokens at its next propose, as after a plain step.
            self.drafter.accept(seq, result.num_accepted if own else 0)
            stats.draft_s += time.perf_counter() - t0
        self.foreign_step = False
        return self._event(new, logits[kept])

    def finish(self) -> StreamEvent:
        """The last event, carrying the whole output and its stats."""
        if self.drafter is not None:
            self.drafter.finish(self.seq)
        self.stats.completion_tokens = self.seq.num_generated
        self.stats.total_s = time.perf_counter() - self.started
        output = GenerationOutput(
            text=self.stops.text,
            token_ids=self.seq.token_ids[self.seq.prompt_len :],
            finish_reason=self.stops.finish_reason,
            logprobs=self.logprobs,
            prompt_token_ids=self.seq.token_ids[: self.seq.prompt_len],
            method=self.drafter.name if self.drafter is not None else "none",
            stats=self.stats,
        )
        return StreamEvent(self.stops.take_text(final=True), [], output)


def _check_finite(logits: Tensor) -> None:
    """Refuse NaN or infinite logits (damaged weights): argmax would quietly turn them into token 0.
    Their sum is finite when every logit is, and one reduction costs a tenth of an element-wise
    test with its mask; only a sum that is not (huge finite logits could overflow it) is looked
    at element by element."""
    if not torch.isfinite(logits.sum()) and not torch.isfinite(logits).all():
        raise NonFiniteLogitsError("the model produced NaN or infinite logits; its weights may be damaged: "
                                   "re-install or re-convert the model (e.g. `specdecode models pull NAME`)")


def _pick(logits: Tensor, seq: SequenceState) -> int:
    """One token from target logits [1, V] by the request's sampling rule: the argmax, or the
    race winner of the next position."""
    if seq.params.greedy:
        return int(greedy(logits)[0])
    keys = seq.keys.at(len(seq.token_ids), logits.shape[-1])
    return int(race(logits_to_probs(logits, seq.params)[0], keys))


def _row_keys(seq: SequenceState, proposal: DraftProposal, vocab: int) -> Tensor | None:
    """A sampled request's race keys [K + 1, V] for the verify rows of ``proposal``: row 0 decides
    the next position, the row after draft i the position after it (a tree: after its depth)."""
    if seq.keys is None:
        return None
    base = len(seq.token_ids)
    return torch.stack([seq.keys.at(base + d, vocab) for d in [0, *proposal.depths]])
