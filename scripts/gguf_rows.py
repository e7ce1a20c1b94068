"""Time the native GGUF kernel over every matrix of a model, per row count.

    python scripts/gguf_rows.py [MODEL] [--rows 1,2,4,8,9,12,16] [--by-type]

MODEL is a catalog name (default: the 1.5B target) or a .gguf file; ``SPECDECODE_GGUF_ISA``
picks the kernel build (portable, avx2 or vnni; by default the fastest this CPU runs). Prints the
best of three passes over all quantized matrices (the embedding table excepted: a decode step
reads one row of it), i.e. the weight part of one forward of that many rows.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from specdecode.models import gguf_load, native
from specdecode.models.catalog import CATALOG, find_weight_files
from specdecode.models.gguf_native import GGUFWeight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rows", default="1,2,4,8,9,12,16")
    ap.add_argument("--by-type", action="store_true", help="one line per quantization type")
    args = ap.parse_args()
    sources = find_weight_files(CATALOG[args.model]) if args.model in CATALOG else [Path(args.model)]
    weights = gguf_load.native_weights(sources)
    groups: dict[str, list[GGUFWeight]] = {}
    for name, w in weights.items():
        if isinstance(w, GGUFWeight) and name != "model.embed_tokens.weight":
            groups.setdefault(w.type_name if args.by_type else "all", []).append(w)
    if "lm_head.weight" not in weights and not args.by_type:  # tied: the head reads the embedding
        groups["all"].append(weights["model.embed_tokens.weight"])
    kernel = native.load_gguf()
    print(f"kernel build: {kernel.isa()}, {torch.get_num_threads()} threads")
    for label, ws in groups.items():
        times = []
        for n in (int(r) for r in args.rows.split(",")):
            xs = {w.inp: torch.randn(n, w.inp) for w in ws}
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for w in ws:
                    kernel.linear_gguf(xs[w.inp], [w.part])
                best = min(best, time.perf_counter() - start)
            times.append((n, best))
        mb = sum(w.nbytes for w in ws) / 1e6
        one = times[0][1]
        print(f"{label}: {len(ws)} matrices, {mb:.0f} MB: " +
              "  ".join(f"{n} rows {t * 1e3:.1f} ms ({t / one:.2f}x)" for n, t in times))


if __name__ == "__main__":
    main()
