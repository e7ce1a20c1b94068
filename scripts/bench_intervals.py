"""Each method's speed-up over ``none`` and its 95% interval, from a bench run's results.jsonl:
for runs made before the bench printed intervals, or to compare runs with the same rule.

    python scripts/bench_intervals.py bench-results/s55/greedy1/results.jsonl [more.jsonl ...]

The figures are ``summary.json``'s (``bench/summary.py``: the geometric mean over prompts of
per-prompt ratios, and a bootstrap over the prompts within each category).
"""

from __future__ import annotations

import argparse
import json

from specdecode.bench.summary import summarize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results.jsonl files of bench runs")
    args = ap.parse_args()
    for path in args.results:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for name, m in summarize(rows, {})["methods"].items():
            interval = m.get("speedup_vs_none_interval")
            if m.get("speedup_vs_none") is None or name == "none":
                continue
            spread = f" ({interval[0]:.2f}-{interval[1]:.2f})" if interval else ""
            print(f"{path}: {name} {m['speedup_vs_none']:.3f}x{spread} over {m['prompts']} prompts")


if __name__ == "__main__":
    main()
