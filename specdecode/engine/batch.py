"""The step loop: every path that decodes (``LLM.generate``, the CLI, the bench, the server) runs
its requests through a ``Batch``; a solo request is a batch of one.

One ``step()``: run the next prefill chunk of the oldest request still prefilling (a long prompt
delays the others by one chunk, never by its whole prefill; a request whose prefill ends gets its
first token now and decodes from the next step); ask the speculation policy for each decoding
request's draft length; draft for all of them at once (``drafting.py``: requests on one
draft model share its forwards, whatever drafter wraps it); verify every request's drafts in ONE
target forward (``Decoder.forward_batch``: the rows share each pass over the weights, which is
what a decode step costs on a CPU; acceptance stays ragged per request); commit; report the
step's measured costs to the policy. The target's kernels are batch-invariant, so each request
gets exactly the tokens it would get alone.

Samples of one prompt (``n`` > 1) share its prefill: a request added with ``shares`` waits while
the request it names prefills, then copies that prompt's keys and values and starts on the same
last-row logits (``Generation.start_shared``; the kernels are row-invariant, so these are the bits
its own prefill would compute). Should the named request leave before its prefill ends, the
waiting ones prefill for themselves.

A request that fails (a bad grammar mid-way, NaN logits) fails alone; a failed shared forward
fails the requests in it. A cancelled request leaves at the next step. A request that leaves
hands its cache back to the prefix cache (``models/prefix_cache.py``), which keeps it for later
requests, or frees it when the request failed (a failed forward may leave it half written).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from specdecode.engine.costs import RequestOutcome, StepTimes
from specdecode.engine.drafting import DraftWork, draft_all
from specdecode.engine.generation import Generation, StreamEvent
from specdecode.engine.policy import DraftRequest, SpeculationPolicy
from specdecode.engine.trace import RequestRecord, StepRecord, step_trace
from specdecode.models.prefix_cache import PrefixCache
from specdecode.drafters.base import DraftSource
from specdecode.errors import DamagedCacheError
from specdecode.models.decoder import Decoder
from specdecode.models.watch import WATCH
from specdecode.sequence import EMPTY_PROPOSAL, DraftProposal

HORIZON = 256  # most tokens a request is counted on to make: max_tokens bounds it, EOS often comes sooner


def _never() -> bool:
    return False


@dataclass(eq=False)
class Member:
    """One request in the batch. ``tag``: the caller's handle for it (a server's job)."""

    gen: Generation
    tag: Any = None
    cancelled: Callable[[], bool] = _never
    chunks: list[Tensor] = field(default_factory=list)  # prefill chunks not run yet
    failed: BaseException | None = None
    source: Member | None = None  # the request whose prefill of the same prompt this one waits for

    @property
    def prefilling(self) -> bool:
        return bool(self.chunks)

    @property
    def ready(self) -> bool:
        """Past its prefill (its own or a shared one) and not failed: it decodes this step."""
        return not self.chunks and self.source is None and self.failed is None


@dataclass(slots=True)
class StepOutcome:
    """What a step produced: events to deliver, requests that failed, and every request that
    left the batch (finished, failed or cancelled), in that order of handling."""

    events: list[tuple[Member, StreamEvent]] = field(default_factory=list)
    failed: list[tuple[Member, BaseException]] = field(default_factory=list)
    left: list[Member] = field(default_factory=list)


class Batch:
    """Requests advanced together, one target forward per step."""

    def __init__(self, target: Decoder, policy: SpeculationPolicy, cap: Callable[[int], int | None] | None = None,
                 caches: PrefixCache | None = None) -> None:
        """``cap``: the most drafts per request for a number of running requests (a server's
        ``--k-by-load`` table), over whatever the policy chooses. ``caches``: where requests'
        caches go back when they leave (caches not taken from it are left alone)."""
        self.target, self.policy, self.cap, self.caches = target, policy, cap, caches
        self.members: list[Member] = []
        self.last_k = 0  # the most drafts any request was allowed in the last step (a server gauge)
        self.trace = step_trace()  # SPECDECODE_STEP_TRACE: a line of times per step (engine/trace.py)

    def __len__(self) -> int:
        return len(self.members)

    def add(self, gen: Generation, tag: Any = None, cancelled: Callable[[], bool] = _never,
            shares: Member | None = None) -> Member:
        """Add a request. ``shares``: a member with the same prompt, still prefilling, whose
        prefill this request takes instead of running its own (see the module docstring); it is
        ignored when ``gen`` cannot start on it (``Generation.can_start_on``) or ``shares`` is done
        prefilling."""
        if shares is not None and shares in self.members and shares.prefilling and gen.can_start_on(shares.gen):
            member = Member(gen, tag, cancelled, source=shares)
        else:
            member = Member(gen, tag, cancelled, gen.prefill_chunks())
        self.members.append(member)
        return member

    def step(self) -> StepOutcome:
        out = StepOutcome()
        record = StepRecord(running=len(self.members)) if self.trace is not None else None
        t0 = time.perf_counter()
        for m in [m for m in self.members if m.cancelled()]:
            self._leave(m, out)
        try:
            WATCH.check()  # a mapped weight file found damaged: no forward may run on it
        except DamagedCacheError as exc:
            for m in list(self.members):
                self._leave(m, out, exc)
            return out
        # A request whose prefill ends this step decodes from the next one: its first token (the
        # prefill's) is delivered as soon as the prefill ends, not after a decode forward and, for
        # a draft model, its catch-up on the whole prompt (up to a second on a 2-core CPU). The
        # work is the same, one step later.
        starting = {m for m in self.members if not m.ready}
        prefilling = [m for m in self.members if m.prefilling]
        if prefilling:
            if record is not None:
                record.prefill_tokens = int(prefilling[0].chunks[0].numel())
            self._prefill_chunk(prefilling[0], out)
            if record is not None:
                record.prefill_s = time.perf_counter() - t0
        decoding = [m for m in self.members if m.ready and m not in starting]
        if decoding:
            self._decode(decoding, len(self.members), out, record)
        if record is not None and (prefilling or decoding):
            record.step_s = time.perf_counter() - t0
            self.trace.write(record)
        return out

    def _leave(self, m: Member, out: StepOutcome, error: BaseException | None = None) -> None:
        if error is not None:
            m.failed = error
            out.failed.append((m, error))
        if m in self.members:
            self.members.remove(m)
            out.left.append(m)
            self._hand_back(m, kept=error is None)
            for waiting in self._sharing(m):  # its prefill will not come: they run their own
                waiting.source, waiting.chunks = None, waiting.gen.prefill_chunks()

    def drop_all(self, kept: bool = False) -> list[Member]:
        """Remove every request without an event (the caller ends them). Their caches go back to
        the prefix cache when ``kept`` (they are whole between steps), else are freed."""
        members, self.members = self.members, []
        for m in members:
            self._hand_back(m, kept)
        return members

    def _hand_back(self, m: Member, kept: bool) -> None:
        if self.caches is None:
            return
        if kept:
            self.caches.release(m.gen.cache, m.gen.seq.token_ids)
        else:
            self.caches.discard(m.gen.cache)

    def _prefill_chunk(self, m: Member, out: StepOutcome) -> None:
        gen = m.gen
        try:
            # Invariant rows: a prompt's keys and values do not depend on how it was chunked or
            # which earlier request computed its prefix, so prefix-cached prompts keep every bit.
            logits = self.target.forward(m.chunks.pop(0), gen.cache, last_only=True, capture=gen.capture,
                                         invariant=True)
            if m.chunks:
                return
        except Exception as exc:  # noqa: BLE001 - fails this request only
            self._leave(m, out, exc)
            return
        # The samples sharing this prefill copy the cache first: ``m`` may finish and hand it back.
        for other in self._sharing(m):
            other.source = None
            self._start(other, lambda g=other.gen: g.start_shared(gen.cache, logits, gen.capture), out)
        self._start(m, lambda: gen.start(logits), out)

    def _sharing(self, m: Member) -> list[Member]:
        """The members waiting for ``m``'s prefill."""
        return [other for other in self.members if other.source is m]

    def _start(self, m: Member, start: Callable[[], StreamEvent], out: StepOutcome) -> None:
        """Pick ``m``'s first token with ``start``; a request done at once (one token, EOS) leaves."""
        try:
            out.events.append((m, start()))
            if m.gen.finished:
                out.events.append((m, m.gen.finish()))
                self._leave(m, out)
        except Exception as exc:  # noqa: BLE001 - fails this request only
            self._leave(m, out, exc)

    def _decode(self, decoding: list[Member], running: int, out: StepOutcome, record: StepRecord | None = None) -> None:
        traced: dict[Member, RequestRecord] = {}
        t_draft = time.perf_counter()
        proposals, works, sources = self._draft(decoding, running, out, traced if record is not None else None)
        catch_ups = [c for work in works.values() for c in work.catch_ups]
        if record is not None:
            record.draft_s, record.catch_ups = time.perf_counter() - t_draft, catch_ups
        batch: list[tuple[Member, Tensor]] = []
        for m in decoding:
            if m.failed is not None:
                continue
            try:
                work = works.get(m)
                inputs = m.gen.plan(proposals.get(m, EMPTY_PROPOSAL), work.seconds if work else 0.0)
            except Exception as exc:  # noqa: BLE001 - fails this request only
                self._leave(m, out, exc)
                continue
            if inputs is None:  # the context is full
                out.events.append((m, m.gen.finish()))
                self._leave(m, out)
            else:
                batch.append((m, inputs))
        if not batch:
            return
        t0 = time.perf_counter()
        try:
            logits = self._verify(batch)
        except Exception as exc:  # noqa: BLE001 - a bug, not user input: fails these requests
            for m, _ in batch:
                self._leave(m, out, exc)
            return
        forward_s = time.perf_counter() - t0
        step = StepTimes(sum(int(inputs.shape[0]) for _, inputs in batch), forward_s, catch_ups=catch_ups)
        if record is not None:
            record.rows, record.verify_s = step.rows, forward_s
        for (m, _), rows in zip(batch, logits):
            gen = m.gen
            try:
                out.events.append((m, gen.commit(rows, forward_s)))
                if not gen.forced_step and m in sources:
                    work, source = works.get(m), sources[m]
                    step.requests.append(RequestOutcome(source.name, gen.speculation_for(source.name),
                                                        gen.proposal.depth, gen.accepted,
                                                        work.solo_s - work.catch_up_s if work else 0.0))
                    gen.stats.free_drafts += bool(gen.proposal.k) and source.cost_prior == 0
                if m in traced:
                    traced[m].drafted, traced[m].accepted = gen.proposal.k, gen.accepted
                if gen.finished:
                    out.events.append((m, gen.finish()))
                    self._leave(m, out)
            except Exception as exc:  # noqa: BLE001 - fails this request only
                self._leave(m, out, exc)
        self.policy.record(step)
        if record is not None:
            record.commit_s = time.perf_counter() - t0 - forward_s
            record.requests = [traced.get(m, RequestRecord(None)) for m, _ in batch]

    def _verify(self, batch: list[tuple[Member, Tensor]]) -> list[Tensor]:
        """ONE target forward over every request's inputs (a lone request takes ``forward``)."""
        if len(batch) == 1:
            (m, inputs), = batch
            return [self.target.forward(inputs, m.gen.cache, tree=m.gen.tree, capture=m.gen.capture)]
        return self.target.forward_batch([(inputs, m.gen.cache) for m, inputs in batch],
                                         trees=[m.gen.tree for m, _ in batch],
                                         captures=[m.gen.capture for m, _ in batch])

    def _draft(self, decoding: list[Member], running: int, out: StepOutcome,
               traced: dict[Member, RequestRecord] | None = None,
               ) -> tuple[dict[Member, DraftProposal], dict[Member, DraftWork], dict[Member, DraftSource]]:
        """This step's drafts for ``decoding``, from the sources and at the lengths the policy
        chose: the proposals, each drafting request's work (its times and catch-ups) and the
        source the policy picked for each request that had one (and, into ``traced``, each one's
        source and planned length for the step trace)."""
        drafting = [m for m in decoding if m.gen.drafts]
        options = [[(source, _draft_request(m.gen, source)) for source in m.gen.sources()] for m in drafting]
        members = [m for m, opts in zip(drafting, options) if opts]  # a drafter may have nothing to offer
        options = [opts for opts in options if opts]
        picks = self.policy.pick_sources([[r for _, r in opts] for opts in options]) if options else []
        chosen = [opts[i] for opts, i in zip(options, picks)]
        plans = self.policy.plan([r for _, r in chosen], running, self.cap) if chosen else []
        self.last_k = max((k for k, _ in plans), default=0)
        works: dict[Member, DraftWork] = {}
        picked: dict[Member, DraftSource] = {}
        for m, (source, _), (k, stop) in zip(members, chosen, plans):
            picked[m] = source
            if traced is not None:
                traced[m] = RequestRecord(source.name, k)
            m.gen.draft_from(source)
            if source.stop is not None:  # this step's stop, or the drafter's own (a fixed K)
                source.stop(stop)
            if k > 0:
                works[m] = DraftWork(source.draft(m.gen.seq, k))
        draft_all(list(works.values()))
        proposals = {}
        for m, work in works.items():
            if work.error is not None:
                self._leave(m, out, work.error)
            else:
                proposals[m] = work.proposal
        return proposals, works, picked


def _draft_request(gen: Generation, source: DraftSource) -> DraftRequest:
    seq = gen.seq
    k_max = gen.k_max if source.limit is None else min(gen.k_max, source.limit)
    return DraftRequest(source.name, k_max, gen.draft_room(), gen.adaptive, source.catch_up,
                        min(seq.params.max_tokens - seq.num_generated, HORIZON), gen.speculation_for(source.name),
                        source.cost_prior, confident=source.stop is not None,
                        acceptance_prior=source.acceptance_prior, shared=source.shared)
