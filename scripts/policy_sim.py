"""Replay recorded greedy drafts through the speculation policy at fixed costs: what a policy change
does to ``draft_model``'s speed, without a bench run's timing noise.

A trace (``scripts/draft_agreement.py --traces``) holds, for each answer the target gave, whether
the draft's top token agreed with the target's at each position (teacher-forced) and the draft's
probability of its top token there. Under greedy verification a chain drafted from position p
keeps exactly its leading agreements, so a step's outcome follows from the trace: the policy
(``engine/policy.py``'s ``CostModel``, the object the engine runs) picks K and a confidence stop,
the drafter drafts until K or until the product of its probabilities falls below the stop (that
token still proposed), and the step keeps the leading agreements plus one token. Costs are a
line per verify row, a fixed cost per drafted token and per caught-up token (defaults: this
machine's, docs/PERFORMANCE.md); each measured time the policy records carries ``--noise``.
Prompts run in the trace's order through one policy, as a bench runs them.

    python scripts/draft_agreement.py bench-results/s40-all/results.jsonl --quantize int4 --vocab 65536 \\
        --traces traces.jsonl
    python scripts/policy_sim.py traces.jsonl [--step-ms 38 --row-share 0.23 --draft-ms 8.5] [--oracle] [--perfect]

Prints each category's speed over plain decoding as the bench computes it (prompt prefill
included, the geometric mean of per-prompt ratios), with the plain steps and drafted tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from specdecode.drafters.base import CATCH_UP_TOKENS
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine.batch import HORIZON
from specdecode.engine.costs import RequestOutcome, RequestSpeculation, StepTimes
from specdecode.engine.policy import CostModel, DraftRequest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", type=Path, help="JSON lines from scripts/draft_agreement.py --traces")
    ap.add_argument("--step-ms", type=float, default=38.0, help="one-row target step (default: %(default)s)")
    ap.add_argument("--row-share", type=float, default=0.23, help="an extra verify row, in steps (default: %(default)s)")
    ap.add_argument("--draft-ms", type=float, default=8.5, help="one drafted token (default: %(default)s)")
    ap.add_argument("--catch-up-ms", type=float, default=1.9, help="one caught-up token (default: %(default)s)")
    ap.add_argument("--prefill-ms", type=float, default=8.5, help="one prompt token of the target (default: %(default)s)")
    ap.add_argument("--k-max", type=int, default=12, help="most drafts a step (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128, help="the requests' max_tokens (default: %(default)s)")
    ap.add_argument("--noise", type=float, default=0.05, help="relative noise of measured times (default: %(default)s)")
    ap.add_argument("--seeds", type=int, default=5, help="runs with different noise, averaged (default: %(default)s)")
    ap.add_argument("--oracle", action="store_true",
                    help="instead of the policy, draft exactly the tokens the target will accept (up to --k-max "
                         "and the room; none where the first would be rejected): about the best any policy over "
                         "this draft can do (it still pays a catch-up after plain steps)")
    ap.add_argument("--perfect", action="store_true",
                    help="--oracle on traces whose every draft agrees, so each step drafts --k-max (or what "
                         "the room leaves): the ceiling of any draft model at these costs and --k-max, however "
                         "good its drafts (a goal above it needs cheaper drafts or rows)")
    ap.add_argument("--calibration", action="store_true",
                    help="first print how often the draft's top token agrees with the target's, by its probability")
    args = ap.parse_args()
    traces = [json.loads(line) for line in args.traces.read_text().splitlines() if line.strip()]
    if args.calibration:
        _print_calibration(traces)
    if args.perfect:
        args.oracle = True
        for t in traces:
            t["match"], t["p"] = [True] * len(t["match"]), [1.0] * len(t["p"])
    ratios: dict[str, list[float]] = {}
    plain_steps: dict[str, int] = {}
    drafted: dict[str, int] = {}
    for seed in range(args.seeds):
        sim = Replay(args, random.Random(seed))
        for t in traces:
            ratio, plain, tokens = sim.run(t)
            ratios.setdefault(t["category"], []).append(ratio)
            plain_steps[t["category"]] = plain_steps.get(t["category"], 0) + plain
            drafted[t["category"]] = drafted.get(t["category"], 0) + tokens
    every = [r for rs in ratios.values() for r in rs]
    for category, rs in ratios.items():
        print(f"{category:14s} {_geomean(rs):.3f}x  plain steps {plain_steps[category] / args.seeds:6.1f}  "
              f"drafted {drafted[category] / args.seeds:6.1f}")
    print(f"{'all':14s} {_geomean(every):.3f}x")


class Replay:
    """One policy replaying traces at the given costs."""

    def __init__(self, args: argparse.Namespace, rng: random.Random) -> None:
        self.args, self.rng = args, rng
        self.policy = CostModel()

    def _measured(self, seconds: float) -> float:
        return seconds * (1 + self.rng.uniform(-self.args.noise, self.args.noise))

    def run(self, trace: dict) -> tuple[float, int, int]:
        """(speed over plain decoding, plain steps, drafted tokens) of one answer."""
        a, step = self.args, self.args.step_ms / 1e3
        match, probs = trace["match"], trace["p"]
        n = len(match)
        state = RequestSpeculation()
        pending = trace["prompt_tokens"]  # tokens the draft model has not fed
        pos, seconds, plains, drafted_total = 0, 0.0, 0, 0
        while pos < n:
            remaining = n - pos
            catch_up = pending if pending > CATCH_UP_TOKENS else 0
            request = DraftRequest("draft_model", a.k_max, remaining - 1, True, catch_up, min(a.max_tokens - pos, HORIZON), state,
                                   DraftModelDrafter.draft_cost_prior, confident=True)
            if a.oracle:
                k, stop = _leading(match, pos, min(a.k_max, remaining - 1)), 0.0
            else:
                [(k, stop)] = self.policy.plan([request])
            outcome_steps = StepTimes(rows=1, verify_s=0.0)
            if k == 0:
                plains += 1
                pending += 1
                verify = step
                produced = 1
            else:
                if catch_up:
                    cost = self._measured(0.006 + a.catch_up_ms / 1e3 * catch_up)
                    seconds += cost
                    outcome_steps.catch_ups.append((catch_up, cost))
                drafted, product = 0, 1.0
                while drafted < k:
                    product *= probs[pos + drafted] if pos + drafted < n else 0.0
                    drafted += 1
                    if product < (0.5 if stop is None else stop):
                        break
                kept = 0
                while kept < drafted and pos + kept < n and match[pos + kept]:
                    kept += 1
                draft_s = self._measured(drafted * a.draft_ms / 1e3)
                seconds += draft_s
                verify = step * (1 + a.row_share * drafted)
                produced = kept + 1
                pending = 1 if kept < drafted else 2
                drafted_total += drafted
                outcome_steps.rows = 1 + drafted
                outcome_steps.requests.append(RequestOutcome("draft_model", state, drafted, kept, draft_s))
            outcome_steps.verify_s = self._measured(verify)
            seconds += verify
            self.policy.record(outcome_steps)
            pos += produced
        prefill = trace["prompt_tokens"] * a.prefill_ms / 1e3
        return (prefill + n * step) / (prefill + seconds), plains, drafted_total


def _print_calibration(traces: list[dict]) -> None:
    """Agreement by the draft's probability of its top token, in tenths: how far a confident
    drafter's own probability can be trusted."""
    bins = [[0, 0] for _ in range(10)]
    for t in traces:
        for agreed, p in zip(t["match"], t["p"]):
            b = bins[min(int(p * 10), 9)]
            b[0], b[1] = b[0] + 1, b[1] + bool(agreed)
    for i, (n, agreed) in enumerate(bins):
        if n:
            print(f"p in [{i / 10:.1f}, {(i + 1) / 10:.1f}): {n:5d} positions, agreement {agreed / n:.3f}")
    after = [t["match"][i + 1] for t in traces for i in range(len(t["match"]) - 1)
             if t["match"][i] and t["p"][i] >= 0.7]
    if after:
        print(f"after a kept token of p >= 0.7: {len(after)} positions, agreement {sum(map(bool, after)) / len(after):.3f}")


def _leading(match: list[bool], pos: int, k_max: int) -> int:
    """The agreements from ``pos`` on before the first disagreement, at most ``k_max``."""
    n = 0
    while n < k_max and pos + n < len(match) and match[pos + n]:
        n += 1
    return n


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


if __name__ == "__main__":
    main()
