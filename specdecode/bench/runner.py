"""Run every contestant on every prompt, fairly, and check that speculation changed nothing.

Fairness rules: one process; contestants interleaved per prompt (for each
prompt, for each repeat: A B C), so slow drift of the machine (thermal state, another process, the
page cache) hits every method alike, and their order rotated from one prompt and repeat to the
next (A B C, B C A, C A B, ...), so that no method always runs first or right after another;
one warm-up generation per contestant before any timing;
prefill and decode times kept apart. Under greedy decoding every output is compared token by token
with ``none`` on the same prompt and repeat: a mismatch is printed loudly and recorded, never
averaged away.

A *contestant* is anything that turns prompt ids into a ``GenerationOutput``: our engine with one
drafter and K, a Hugging Face peer (``peers.py``), or a deliberately broken fake in the tests.
"""

from __future__ import annotations

import logging
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdecode.bench.workloads import Prompt, last_code_block
from specdecode.params import MAX_SPECULATIVE_TOKENS, SamplingParams
from specdecode.drafters.registry import DRAFT_MODEL_METHODS, METHOD_NAMES, build_drafter
from specdecode.engine.generation import GenerationOutput
from specdecode.errors import InvalidConfigError, SpecDecodeError
from specdecode.models.decoder import Decoder

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from specdecode.api import LLM

# A contestant takes the prompt in its own form: token ids for an engine, chat messages or text
# for an HTTP endpoint. ``Render`` turns the conversation so far into that form.
Generate = Callable[[Any, SamplingParams], GenerationOutput]
Render = Callable[[list[dict[str, str]]], Any]
RowSink = Callable[[dict[str, Any]], None]

BASELINE = "none"
WARMUP_TOKENS = 8


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One row of the report: a method at one K (``k`` is None for ``none``)."""

    name: str  # "draft_model", "draft_model@k=4" under --sweep-k, "...+fixed" for fixed K
    method: str
    k: int | None
    adaptive: bool = True  # the speculation policy picks the draft length, up to k (engine/policy.py)
    predicted: bool = False  # requests carry the prompt's last code block as their prediction ("+prediction")


@dataclass(frozen=True, slots=True)
class Contestant:
    name: str
    method: str
    k: int | None
    kind: str  # "ours", "peer" (Hugging Face, llama.cpp, vLLM) or "endpoint"
    generate: Generate
    counts_drafts: bool = False  # a peer that reports its drafts and acceptances (vLLM's counters)
    exact: bool = True  # False: its output is not meant to be the target's (synthetic acceptance)


@dataclass(frozen=True, slots=True)
class Detached:
    """A contestant that cannot run beside the others: a vLLM server holds its own float copy of
    the weights, and two of them beside ours do not fit in this machine's memory. Each runs after
    the interleaved loop, one at a time (``running`` starts its server and stops it on exit), on
    the same prompts, compared with the ``none`` outputs kept from the loop."""

    contestant: Contestant
    running: Callable[[], AbstractContextManager[Any]]


@dataclass(slots=True)
class BenchResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)  # identity mismatches of ours
    peer_errors: list[dict[str, str]] = field(default_factory=list)  # detached peers that could not run
    target_step_s: float | None = None  # one target forward of one token, measured in this run
    peak_rss_mb: float = 0.0
    wall_s: float = 0.0


def plan_runs(methods: Sequence[str], ks: Sequence[int], sweep: bool,
              schedules: Sequence[str] = ("adaptive",), prediction: bool = False) -> list[RunSpec]:
    """``none`` first (it is every comparison's reference), then each method at each K.

    Under ``--sweep-k`` every speculative method appears once per K, named ``METHOD@k=K``; without
    it the plain method name is used. Every row also carries ``method`` and ``k`` fields.
    ``schedules`` holds "adaptive" and/or "fixed"; with both, fixed-K rows get a ``+fixed`` suffix.
    ``prediction`` adds each row again (``none`` too) as ``NAME+prediction``, whose requests carry
    the prompt's last code block as a predicted output (``workloads.last_code_block``).
    """
    unknown = [m for m in methods if m not in METHOD_NAMES]
    if unknown:
        raise InvalidConfigError(f"unknown method {unknown[0]!r} in --methods; choose from {', '.join(METHOD_NAMES)}")
    for k in ks:
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise InvalidConfigError(f"K must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
    runs = [RunSpec(BASELINE, BASELINE, None)]
    for method in dict.fromkeys(methods):  # de-duplicated, order kept
        if method == BASELINE:
            continue
        for k in dict.fromkeys(ks):
            name = f"{method}@k={k}" if sweep else method
            for schedule in schedules:
                suffix = "+fixed" if schedule == "fixed" and len(schedules) > 1 else ""
                runs.append(RunSpec(name + suffix, method, k, adaptive=schedule == "adaptive"))
    if prediction:
        runs += [replace(run, name=f"{run.name}+prediction", predicted=True) for run in runs]
    return runs


def our_contestants(llm: LLM, runs: Sequence[RunSpec]) -> list[Contestant]:
    """Contestants over one loaded ``LLM``: all share the target weights and the engine's cache.
    Under synthetic acceptance (``llm.spec.synthetic_acceptance``) speculative rows are not exact."""
    exact = llm.spec.synthetic_acceptance is None
    contestants = []
    for run in runs:
        def generate(ids: list[int], params: SamplingParams, run=run) -> GenerationOutput:
            # Each request is measured on its own: a history holding the warm-up or an earlier
            # repeat of this very prompt would flatter drafters that learn across requests.
            llm.suffix_history.clear()
            if run.predicted:
                params = replace(params, prediction=last_code_block(llm.tokenizer.decode(ids)))
            return llm.generate(ids, params, run.method, run.k, adaptive=run.adaptive)[0]

        contestants.append(Contestant(run.name, run.method, run.k, "ours", generate,
                                      exact=exact or run.method == BASELINE))
    return contestants


def draft_contestants(llm: LLM, runs: Sequence[RunSpec], name: str, draft: Decoder) -> list[Contestant]:
    """The draft-model runs of ``runs`` again with another ``draft`` (loaded by ``load_draft``),
    named ``METHOD[NAME]``: two drafts of one target compared on the same prompts in one run."""
    resources = replace(llm.resources, draft_model=draft, draft_name=name)
    label = Path(name).name or name
    contestants = []
    for run in runs:
        if run.method not in DRAFT_MODEL_METHODS:
            continue
        spec = replace(llm.spec, method=run.method, num_speculative_tokens=run.k, adaptive=run.adaptive)
        drafter = build_drafter(run.method, resources, llm.engine.max_seq_len)

        def generate(ids: list[int], params: SamplingParams, spec=spec, drafter=drafter) -> GenerationOutput:
            return llm.engine.generate(ids, params, drafter, spec)

        contestants.append(Contestant(f"{run.name}[{label}]", run.method, run.k, "ours", generate,
                                      exact=llm.spec.synthetic_acceptance is None))
    return contestants


def load_draft(llm: LLM, name: str, draft_quantize: str | None) -> Decoder:
    """Draft ``name`` loaded as ``LLM`` loads its own (its LM head restricted as ``draft_vocab``
    says); refused unless it speaks the target's vocabulary."""
    from specdecode.config import DEFAULT_DRAFT_VOCAB
    from specdecode.drafters.draft_vocab import restricted_draft
    from specdecode.drafters.vocab import same_vocabulary
    from specdecode.models import draft_quant
    from specdecode.models.catalog import resolve_model
    from specdecode.tokenizer import Tokenizer

    path = resolve_model(name)
    draft = Decoder.from_dir(path, llm.model_spec.dtype, role="draft",
                             quantize=draft_quant.usable_mode(draft_quantize, llm.model_spec.dtype))
    size = llm.target.config.vocab_size
    same = (same_vocabulary(llm.tokenizer, Tokenizer.from_dir(path), size, draft.config.vocab_size)
            if (path / "tokenizer.json").is_file() else draft.config.vocab_size == size)
    if not same:
        raise InvalidConfigError(f"--compare-drafts {name}: its vocabulary differs from the target's; compare "
                                 "drafts of the target's own vocabulary")
    return restricted_draft(draft, llm.spec.draft_vocab, DEFAULT_DRAFT_VOCAB, llm.tokenizer)


def target_step_timer(llm: LLM, context_ids: list[int], repeats: int = 5) -> Callable[[], float]:
    """Median seconds of one single-token target forward after ``context_ids``: the cost of one
    plain decoding step, from which the ideal speed of a method is mean_acceptance_length / step."""

    def measure() -> float:
        import torch

        cache = llm.engine.cache
        cache.reset()
        llm.target.forward(torch.tensor(context_ids), cache, last_only=True)
        token = torch.tensor(context_ids[-1:])
        samples = []
        for _ in range(repeats + 1):  # the first call warms up
            start = time.perf_counter()
            llm.target.forward(token, cache)
            samples.append(time.perf_counter() - start)
            cache.trim(1)
        cache.reset()
        return statistics.median(samples[1:])

    return measure


def run_benchmark(
    contestants: Sequence[Contestant],
    prompts: Sequence[Prompt],
    params: SamplingParams,
    render: Render,
    repeat: int = 1,
    step_timer: Callable[[], float] | None = None,
    on_row: RowSink | None = None,
    progress: bool = True,
    detached: Sequence[Detached] = (),
    fresh: Callable[[], None] | None = None,
) -> BenchResult:
    """Warm up, then for each prompt and repeat, each contestant in turn, starting one further
    along each time (``_rotated``): converse; then record the prompt's rows in the given order
    (``none`` first, the reference the others are checked against); then each ``detached``
    contestant alone, on every prompt and repeat.

    ``render`` turns a message list into the contestants' prompt (for our engine: the chat
    template's token ids). ``fresh`` forgets our engine's cached prefixes; it runs before every
    conversation, so each starts cold and later turns reuse only their own conversation's.
    """
    from tqdm import tqdm

    if not prompts or not contestants:
        raise InvalidConfigError("nothing to benchmark: no prompts or no methods")
    start = time.perf_counter()
    result = BenchResult()
    if progress:
        log.info(f"bench: warming up {len(contestants)} contestant(s), then {len(prompts)} prompt(s) x {repeat} "
                 "repeat(s)")
    _warm_up(contestants, prompts[0], params, render)
    if step_timer is not None:
        result.target_step_s = step_timer()
    bar = tqdm(total=len(prompts) * repeat * (len(contestants) + len(detached)), desc="bench", unit="gen",
               file=sys.stderr, disable=not progress, dynamic_ncols=True, mininterval=0.5)
    references: dict[tuple[int, int], list[GenerationOutput]] = {}
    with bar:
        for index, prompt in enumerate(prompts):
            prompt_params = _seeded(params, index)
            for rep in range(repeat):
                outputs: dict[int, list[GenerationOutput]] = {}
                for i in _rotated(len(contestants), index * repeat + rep):
                    contestant = contestants[i]
                    bar.set_postfix_str(f"{prompt.id} {contestant.name}", refresh=False)
                    if fresh is not None:
                        fresh()
                    outputs[i] = converse(contestant.generate, prompt, prompt_params, render)
                    bar.update(1)
                for i, contestant in enumerate(contestants):  # recorded in the given order: none's first
                    if contestant.name == BASELINE and contestant.kind == "ours":
                        references[index, rep] = outputs[i]
                    ref = references.get((index, rep)) if _comparable(params, contestant) and contestant.name != BASELINE else None
                    _record(result, prompt, contestant, rep, outputs[i], ref, on_row, bar)
        for item in detached:
            try:
                _run_detached(item, result, prompts, params, render, repeat, references, on_row, bar)
            except SpecDecodeError as exc:  # one peer that fails must not cost the others' results
                result.peer_errors.append({"peer": item.contestant.name, "error": str(exc)})
                bar.write(f"!!! peer {item.contestant.name} failed: {exc}", file=sys.stderr)
    result.peak_rss_mb = peak_rss_mb()
    result.wall_s = time.perf_counter() - start
    return result


def _run_detached(item: Detached, result: BenchResult, prompts: Sequence[Prompt], params: SamplingParams,
                  render: Render, repeat: int, references: dict[tuple[int, int], list[GenerationOutput]],
                  on_row: RowSink | None, bar: Any) -> None:
    """One detached contestant on every prompt; its rows join ``result`` only once all of them ran,
    so a peer that fails half-way leaves no partial figures."""
    contestant = item.contestant
    own = BenchResult()
    bar.set_postfix_str(f"starting {contestant.name}", refresh=True)
    with item.running():
        _warm_up([contestant], prompts[0], params, render)
        for index, prompt in enumerate(prompts):
            for rep in range(repeat):
                bar.set_postfix_str(f"{prompt.id} {contestant.name}", refresh=False)
                outputs = converse(contestant.generate, prompt, _seeded(params, index), render)
                ref = references.get((index, rep)) if _comparable(params, contestant) else None
                _record(own, prompt, contestant, rep, outputs, ref, None, bar)
                bar.update(1)
    for row in own.rows:
        result.rows.append(row)
        if on_row is not None:
            on_row(row)


def _rotated(n: int, shift: int) -> list[int]:
    """Indices 0 .. n - 1 starting at ``shift`` mod n: the run order of a prompt's contestants."""
    start = shift % n
    return [*range(start, n), *range(start)]


def _seeded(params: SamplingParams, index: int) -> SamplingParams:
    """Prompt ``index``'s sampling settings: seed SEED + index, the same for every contestant."""
    return replace(params, seed=params.seed + index) if params.seed is not None else params


def converse(generate: Generate, prompt: Prompt, params: SamplingParams, render: Render) -> list[GenerationOutput]:
    """Send each user turn after the model's own previous answer (Spec-Bench's multi-turn rule)."""
    messages: list[dict[str, str]] = []
    outputs = []
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        out = generate(render(messages), params)
        outputs.append(out)
        messages.append({"role": "assistant", "content": out.text})
    return outputs


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def _warm_up(contestants: Sequence[Contestant], prompt: Prompt, params: SamplingParams, render: Render) -> None:
    """One short untimed generation per contestant: first-call costs (allocation, kernel
    selection, lazy imports inside transformers) must not land on the first timed prompt."""
    ids = render([{"role": "user", "content": prompt.turns[0]}])
    short = replace(params, max_tokens=min(WARMUP_TOKENS, params.max_tokens))
    for contestant in contestants:
        contestant.generate(ids, short)


def _comparable(params: SamplingParams, contestant: Contestant) -> bool:
    """Whether ``contestant``'s output must equal plain decoding's token for token: greedy, or, for
    our engine, seeded sampling (each sampled token wins a race keyed by the seed and its position,
    whatever drafted it); a peer's sampler draws its own way."""
    return params.greedy or (params.seed is not None and contestant.kind == "ours")


def _record(result: BenchResult, prompt: Prompt, contestant: Contestant, rep: int,
            outputs: list[GenerationOutput], reference: list[GenerationOutput] | None,
            on_row: RowSink | None, bar: Any) -> None:
    for turn, out in enumerate(outputs):
        identical: bool | None = None
        diff: int | None = None
        if contestant.name == BASELINE and contestant.kind == "ours":
            identical = True
        elif reference is not None and turn < len(reference) and contestant.exact:
            diff = first_difference(out.token_ids, reference[turn].token_ids)
            identical = diff is None
        row = make_row(prompt, turn, contestant, rep, out, identical, diff)
        result.rows.append(row)
        if on_row is not None:
            on_row(row)
        if identical is False:
            _report_mismatch(result, row, out, reference[turn] if reference else None, contestant, bar)


def _report_mismatch(result: BenchResult, row: dict[str, Any], out: GenerationOutput,
                     ref: GenerationOutput | None, contestant: Contestant, bar: Any) -> None:
    """Ours: loud, on stderr and in the summary. A peer's drift is its own numerics: a note."""
    pos = row["first_mismatch"]
    got = out.token_ids[pos] if pos is not None and pos < len(out.token_ids) else "<end>"
    want = ref.token_ids[pos] if ref is not None and pos is not None and pos < len(ref.token_ids) else "<end>"
    where = f"prompt {row['prompt_id']} turn {row['turn']} repeat {row['repeat']}"
    if contestant.kind == "ours":
        result.failures.append({k: row[k] for k in ("method", "prompt_id", "turn", "repeat", "first_mismatch")})
        bar.write(f"!!! IDENTITY MISMATCH: {contestant.name} differs from none on {where} at token {pos} "
                  f"(got {got}, none gave {want}). Greedy speculative decoding must reproduce plain "
                  "decoding exactly: this is a bug.", file=sys.stderr)
    else:
        bar.write(f"note: peer {contestant.name} differs from specdecode's none on {where} at token {pos} "
                  f"(got {got}, ours {want})", file=sys.stderr)


def make_row(prompt: Prompt, turn: int, contestant: Contestant, rep: int, out: GenerationOutput,
             identical: bool | None, first_mismatch: int | None) -> dict[str, Any]:
    """One results.jsonl row. Fields a contestant cannot measure (a peer's prefill or drafts)
    are null rather than zero, so they never pass for measured values."""
    s = out.stats
    ours = contestant.kind == "ours"
    counted = ours or contestant.counts_drafts  # drafts and acceptance were observed
    speculative = counted and contestant.method != BASELINE
    return {
        "prompt_id": prompt.id, "category": prompt.category, "turn": turn, "repeat": rep,
        "method": contestant.name, "base_method": contestant.method, "k": contestant.k, "kind": contestant.kind,
        "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens if ours else None,
        "completion_tokens": s.completion_tokens,
        "prefill_s": s.prefill_s if ours else None, "ttft_s": s.ttft_s if s.ttft_s > 0 else None,
        "decode_s": s.total_s - s.ttft_s if s.ttft_s > 0 else None, "total_s": s.total_s,
        "tokens_per_s": s.tokens_per_s,
        "decode_tokens_per_s": s.decode_tokens_per_s if s.ttft_s > 0 else None,
        "tpot_s": s.tpot_s if s.ttft_s > 0 else None,
        "target_steps": s.target_steps if ours else None,
        "plain_steps": s.plain_steps if speculative else None,  # steps the policy drafted nothing
        "free_drafts": s.free_drafts if speculative else None,  # drafts copied from a context match
        "prediction_accepted": s.prediction_accepted if ours else None,  # drafts taken from the prediction
        "prediction_rejected": s.prediction_rejected if ours else None,
        "draft_s": s.draft_s if speculative else None, "verify_s": s.verify_s if ours else None,
        "drafts": s.drafts if speculative else None,
        "draft_tokens": s.draft_tokens if speculative else None,
        "accepted_tokens": s.accepted_tokens if speculative else None,
        "acceptance_rate": s.acceptance_rate if speculative else None,
        "mean_acceptance_length": s.mean_acceptance_length if counted else None,
        "accepted_per_position": list(s.accepted_per_position) if speculative else None,
        "drafted_per_position": list(s.drafted_per_position) if speculative else None,
        "identical": identical, "first_mismatch": first_mismatch, "synthetic": not contestant.exact,
        "finish_reason": out.finish_reason, "token_ids": list(out.token_ids), "text": out.text,
    }
