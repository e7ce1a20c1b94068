"""Summarise a step trace (``SPECDECODE_STEP_TRACE``, ``specdecode/engine/trace.py``): per number of
decoding requests in a step, where the step's time went and what it made.

    SPECDECODE_STEP_TRACE=/tmp/steps.jsonl specdecode serve ...   # or any other path that decodes
    python scripts/step_trace.py /tmp/steps.jsonl

Columns: steps; mean milliseconds of the whole step, its prefill chunk, its drafting (of which
catch-ups), its verify forward, its commit and the rest; mean verify rows; the share of steps
in which any request drafted; tokens made per step and per second of step time.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    args = ap.parse_args()
    groups: dict[int, list[dict]] = defaultdict(list)
    for line in args.trace.read_text().splitlines():
        step = json.loads(line)
        groups[len(step["requests"])].append(step)
    print(f"{'reqs':>4} {'steps':>6} {'step':>7} {'prefill':>7} {'draft':>7} {'catchup':>7} {'verify':>7} "
          f"{'commit':>7} {'rest':>6} {'rows':>5} {'drafting':>8} {'tok/step':>8} {'tok/s':>6}")
    for n in sorted(groups):
        steps = groups[n]
        count = len(steps)

        def mean_ms(key: str) -> float:
            return 1000 * sum(s[key] for s in steps) / count

        catch_up = 1000 * sum(sec for s in steps for _, sec in s["catch_ups"]) / count
        parts = sum(mean_ms(k) for k in ("prefill_s", "draft_s", "verify_s", "commit_s"))
        tokens = sum(r["accepted"] + 1 for s in steps for r in s["requests"])
        drafting = sum(any(r["planned"] for r in s["requests"]) for s in steps) / count
        total_s = sum(s["step_s"] for s in steps)
        print(f"{n:4d} {count:6d} {mean_ms('step_s'):7.1f} {mean_ms('prefill_s'):7.1f} {mean_ms('draft_s'):7.1f} "
              f"{catch_up:7.1f} {mean_ms('verify_s'):7.1f} {mean_ms('commit_s'):7.1f} {mean_ms('step_s') - parts:6.1f} "
              f"{sum(s['rows'] for s in steps) / count:5.1f} {drafting:8.0%} {tokens / count:8.2f} "
              f"{tokens / total_s if total_s else 0.0:6.1f}")


if __name__ == "__main__":
    main()
