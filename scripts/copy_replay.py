"""Replay the ``ngram`` drafter's copies through the speculation policy over recorded greedy
answers, at fixed costs: what a change to how copies are priced does, without a bench run's
timing noise (``scripts/policy_sim.py`` does the same for the draft model's drafts).

Greedy speculative decoding emits exactly the plain output, so a copy's fate follows from the
recorded answer (the ``none`` rows of a bench's results.jsonl): after the prefill (which gives
the answer's first token), each step the drafter offers its copy (``Drafter.sources``, named by
match bucket), the policy (``engine/policy.py``'s ``CostModel``, one for the whole replay, as in
a bench) picks its length, the step keeps the copy's leading tokens that match the answer plus
one, and the policy records the step. A copy costs only its verify rows: a step of r rows costs
``--step-ms`` times 1 + ``--row-share`` (r - 1). The answer's length bounds each step's room, as
in ``scripts/policy_sim.py`` (a real request does not know where its answer ends). Prints each
category's speed over plain decoding as the bench pools it (prompt prefill included, the
geometric mean of per-prompt ratios). With ``--oracle``, every step instead copies exactly the
tokens the answer keeps (none when the first would be refused): the best step by step, a bound
on what any pricing of these copies reaches.

    python scripts/copy_replay.py bench-results/s55/greedy1/results.jsonl [--row-share 0.19] [--oracle]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

from specdecode.bench.workloads import WORKLOAD_NAMES, load_workloads
from specdecode.drafters.base import run_alone
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine.batch import HORIZON
from specdecode.engine.costs import RequestOutcome, RequestSpeculation, StepTimes
from specdecode.engine.policy import CostModel, DraftRequest
from specdecode.models.catalog import resolve_model
from specdecode.params import MAX_SPECULATIVE_TOKENS, SamplingParams
from specdecode.sequence import SequenceState
from specdecode.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a bench results.jsonl with rows of method none")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="whose tokenizer and chat template")
    ap.add_argument("--step-ms", type=float, default=31.6, help="one-row target step (default: %(default)s)")
    ap.add_argument("--row-share", type=float, default=0.19, help="an extra verify row, in steps (default: %(default)s)")
    ap.add_argument("--prefill-ms", type=float, default=7.0, help="one prompt token of the target (default: %(default)s)")
    ap.add_argument("--k-max", type=int, default=12, help="most drafts a step (default: %(default)s)")
    ap.add_argument("--oracle", action="store_true", help="copy exactly the tokens the answer keeps")
    args = ap.parse_args()
    tokenizer = Tokenizer.from_dir(resolve_model(args.model))
    prompts = {q.id: q for q in load_workloads(WORKLOAD_NAMES)}
    rows = [json.loads(line) for line in open(args.results, encoding="utf-8")]
    answers = {r["prompt_id"]: r["token_ids"] for r in rows if r["method"] == "none" and r["turn"] == 0}
    policy, step_s = CostModel(), args.step_ms / 1e3
    ratios: dict[str, list[float]] = defaultdict(list)
    copied: dict[str, int] = defaultdict(int)
    for prompt_id, answer in answers.items():
        if prompt_id not in prompts:  # a workload outside the built-in ones (file-edit, agent)
            continue
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompts[prompt_id].turns[0]}]))
        seq = SequenceState(list(prompt), len(prompt), SamplingParams(max_tokens=len(answer)))
        drafter, states = NgramDrafter(), {}
        drafter.begin(seq)
        seq.token_ids.append(answer[0])  # the prefill's token
        pos, seconds = 1, 0.0
        while pos < len(answer):
            room = min(args.k_max, MAX_SPECULATIVE_TOKENS, len(answer) - pos - 1)
            sources = drafter.sources(seq) if room > 0 else ()
            draft: list[int] = []
            if sources:
                source = sources[0]
                state = states.setdefault(source.name, RequestSpeculation())
                if args.oracle:
                    draft = _leading(run_alone(source.draft(seq, min(room, source.limit))).tokens.tolist(), answer, pos)
                else:
                    request = DraftRequest(source.name, min(room, source.limit), room, True, 0,
                                           min(len(answer) - pos, HORIZON), state, source.cost_prior,
                                           acceptance_prior=source.acceptance_prior)
                    [(k, _)] = policy.plan([request])
                    draft = run_alone(source.draft(seq, k)).tokens.tolist() if k else []
            kept = len(_leading(draft, answer, pos))
            verify = step_s * (1 + args.row_share * len(draft))
            step = StepTimes(rows=1 + len(draft), verify_s=verify)
            if sources:
                step.requests.append(RequestOutcome(sources[0].name, states[sources[0].name], len(draft), kept))
            policy.record(step)
            seconds += verify
            seq.token_ids.extend(answer[pos : pos + kept + 1])
            pos += kept + 1
            copied[prompts[prompt_id].category] += len(draft)
        prefill = len(prompt) * args.prefill_ms / 1e3
        ratios[prompts[prompt_id].category].append((prefill + (len(answer) - 1) * step_s) / (prefill + seconds))
    for category, rs in ratios.items():
        print(f"{category:14s} {statistics.geometric_mean(rs):.3f}x  copied {copied[category]}")
    print(f"{'all':14s} {statistics.geometric_mean([r for rs in ratios.values() for r in rs]):.3f}x")


def _leading(draft: list[int], answer: list[int], pos: int) -> list[int]:
    """The leading tokens of ``draft`` that the answer has from ``pos`` on."""
    n = 0
    while n < len(draft) and pos + n < len(answer) and draft[n] == answer[pos + n]:
        n += 1
    return draft[:n]


if __name__ == "__main__":
    main()
