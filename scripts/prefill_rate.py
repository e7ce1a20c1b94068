"""Time the target's prefill at several prompt lengths: one forward over random tokens into a
fresh cache on the engine's batch-invariant path, best of ``--repeat``.

    python scripts/prefill_rate.py [--model qwen2.5-coder-1.5b-instruct] [--lengths 64,150,200]

To compare two commits, run it from each one's tree in turn (``git worktree add /tmp/old REV``,
then ``PYTHONPATH=/tmp/old python scripts/prefill_rate.py``), alternating, on a quiet machine.

With ``--whole-last-layer``, each prefill runs twice in turn: as the engine runs it (the last
layer's o projection and MLP for the last row alone) and with that layer whole for every row;
it prints both and the median of their differences, pair by pair (a host that drifts between
runs moves both of a pair alike).
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.api import LLM
from specdecode.models.decoder import Decoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="(default: %(default)s)")
    ap.add_argument("--lengths", default="64,150,200", help="prompt lengths, comma-separated (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="timed prefills per length (default: %(default)s)")
    ap.add_argument("--whole-last-layer", action="store_true",
                    help="also time each prefill with its last layer run whole, alternating")
    args = ap.parse_args()
    target = LLM(args.model, method="none", progress=False).target
    for n in (int(v) for v in args.lengths.split(",")):
        ids = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n))
        if args.whole_last_layer:
            _against_whole_last_layer(target, ids, args.repeat)
            continue
        best = float("inf")
        for _ in range(args.repeat):
            cache = target.new_cache(n + 8)
            start = time.perf_counter()
            target.forward(ids, cache, last_only=True, invariant=True)
            best = min(best, time.perf_counter() - start)
        print(f"{n} tokens: {best * 1e3:.0f} ms, {best / n * 1e3:.2f} ms a token", flush=True)


def _against_whole_last_layer(target: Decoder, ids: torch.Tensor, repeat: int) -> None:
    """Time ``ids``' prefill as the engine runs it and with its last layer whole, in turn."""
    kept = Decoder._layer

    def whole(self, x, w, i, views, cos, sin, linear, keep=None):  # every row through, then the kept ones
        y = kept(self, x, w, i, views, cos, sin, linear)
        return y if keep is None else y[keep]

    times: dict[str, list[float]] = {"as run": [], "whole": []}
    try:
        for _ in range(repeat):
            for name, layer in (("as run", kept), ("whole", whole)):
                Decoder._layer = layer
                cache = target.new_cache(len(ids) + 8)
                start = time.perf_counter()
                target.forward(ids, cache, last_only=True, invariant=True)
                times[name].append(time.perf_counter() - start)
    finally:
        Decoder._layer = kept
    gaps = sorted(w - r for r, w in zip(times["as run"], times["whole"]))
    print(f"{len(ids)} tokens: as run {min(times['as run']) * 1e3:.0f} ms, last layer whole "
          f"{min(times['whole']) * 1e3:.0f} ms (best of {repeat}); median difference "
          f"{gaps[len(gaps) // 2] * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
