"""The acceptance of each draft source the speculation policy weighs, pooled over built-in workloads.

    python scripts/source_acceptance.py [--method combined] [--limit 3] [--max-tokens 128]

Runs the default pair greedily on the first ``--limit`` prompts of every workload and counts,
per source name (``draft_model``, ``suffix/match1`` ... ``suffix/match16``), the drafts the
acceptance rule decided and kept. ``suffix.COPY_ACCEPTANCE`` (a copy's prior per match length)
comes from this.
"""

from __future__ import annotations

import argparse

from specdecode.api import LLM
from specdecode.bench.workloads import WORKLOAD_NAMES, limit_per_category, load_workloads
from specdecode.engine.costs import StepTimes
from specdecode.params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="combined", help="the method to run (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=3, help="prompts per workload (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default: %(default)s)")
    args = ap.parse_args()
    llm = LLM(method=args.method, progress=False)
    policy = llm.engine.policy
    counts: dict[str, list[int]] = {}
    record = policy.record

    def counting(step: StepTimes) -> None:
        for outcome in step.requests:
            steps_decided_kept = counts.setdefault(outcome.method, [0, 0, 0])
            steps_decided_kept[0] += 1
            steps_decided_kept[1] += outcome.decided
            steps_decided_kept[2] += outcome.accepted
        record(step)

    policy.record = counting  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for prompt in limit_per_category(load_workloads(WORKLOAD_NAMES), args.limit):
        llm.chat([{"role": "user", "content": prompt.turns[0]}], params)
    print(f"{'source':18} {'steps':>6} {'decided':>8} {'kept':>6} {'acceptance':>10}")
    for name, (steps, decided, kept) in sorted(counts.items()):
        print(f"{name:18} {steps:6d} {decided:8d} {kept:6d} {kept / max(decided, 1):10.2f}")


if __name__ == "__main__":
    main()
