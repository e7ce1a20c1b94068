"""Time the target's prefill at several prompt lengths: one forward over random tokens into a
fresh cache on the engine's batch-invariant path, best of ``--repeat``.

    python scripts/prefill_rate.py [--model qwen2.5-coder-1.5b-instruct] [--lengths 64,150,200]

To compare two commits, run it from each one's tree in turn (``git worktree add /tmp/old REV``,
then ``PYTHONPATH=/tmp/old python scripts/prefill_rate.py``), alternating, on a quiet machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.api import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="(default: %(default)s)")
    ap.add_argument("--lengths", default="64,150,200", help="prompt lengths, comma-separated (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="timed prefills per length (default: %(default)s)")
    args = ap.parse_args()
    target = LLM(args.model, method="none", progress=False).target
    for n in (int(v) for v in args.lengths.split(",")):
        ids = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n))
        best = float("inf")
        for _ in range(args.repeat):
            cache = target.new_cache(n + 8)
            start = time.perf_counter()
            target.forward(ids, cache, last_only=True, invariant=True)
            best = min(best, time.perf_counter() - start)
        print(f"{n} tokens: {best * 1e3:.0f} ms, {best / n * 1e3:.2f} ms a token", flush=True)


if __name__ == "__main__":
    main()
