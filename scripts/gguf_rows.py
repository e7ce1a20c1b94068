"""Time the native GGUF kernel over every matrix of a model, per row count.

    python scripts/gguf_rows.py [MODEL] [--rows 1,2,4,8,9,12,16] [--by-type | --by-input] [--isa avx2,vnni] [--rounds N]
                                [--against OTHER.cpp] [--cpu-time]

MODEL is a catalog name (default: the 1.5B target) or a .gguf file. A pass multiplies all its
quantized matrices (the embedding table excepted: a decode step reads one row of it), i.e. the
weight part of one forward of that many rows; a round keeps the best of three passes. ``--isa``
names the kernel builds to time (portable, avx2, vnni; default: the one models use here), taken
in turn within each round so they share the machine's state; each line prints the median over
the rounds, and each build after the first its ratio to the first per row count. ``--against``
adds, per build, the same build of another kernel source (say the main branch's, from ``git show
main:specdecode/models/csrc/linear_gguf.cpp``, saved beside a copy of ``lanes.h``), named
``ISA@FILE`` and timed in turn with the others. ``--cpu-time`` runs one thread and times its CPU
time, which other processes on a shared machine disturb less than the wall clock.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specdecode.models import gguf_load, kernel_build
from specdecode.models.catalog import CATALOG, find_weight_files
from specdecode.models.gguf_planes import GGUFWeight


def best_of_three(kernel, ws: list[GGUFWeight], xs: dict[int, torch.Tensor], clock) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(3):
        start = clock()
        for w in ws:
            kernel.linear_gguf(xs[w.inp], [w.part])
        best = min(best, clock() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rows", default="1,2,4,8,9,12,16", help="row counts (default: %(default)s)")
    ap.add_argument("--by-type", action="store_true", help="one line per quantization type")
    ap.add_argument("--by-input", action="store_true", help="one line per input width (a matrix's activations "
                    "per row: ffn_down's 8960 outgrow L1 at a few rows, the others' 1536 do not)")
    ap.add_argument("--isa", default=None, help="kernel builds to compare, comma-separated "
                    f"(of {', '.join(kernel_build.GGUF_ISAS)}; default: the one models use here)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds; lines show medians (default: %(default)s)")
    ap.add_argument("--against", type=Path, help="another linear_gguf.cpp to time beside each build")
    ap.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    isas = args.isa.split(",") if args.isa else [kernel_build.gguf_isa()]
    unknown = sorted(set(isas) - set(kernel_build.gguf_isas()))
    if unknown:
        ap.error(f"this CPU cannot run {', '.join(unknown)}; it runs {', '.join(kernel_build.gguf_isas())}")
    sources = find_weight_files(CATALOG[args.model]) if args.model in CATALOG else [Path(args.model)]
    weights = gguf_load.native_weights(sources)
    groups: dict[str, list[GGUFWeight]] = {}
    for name, w in weights.items():
        if isinstance(w, GGUFWeight) and name != "model.embed_tokens.weight":
            key = w.type_name if args.by_type else f"in {w.inp}" if args.by_input else "all"
            groups.setdefault(key, []).append(w)
    if "lm_head.weight" not in weights and not (args.by_type or args.by_input):  # tied: the head reads the embedding
        groups["all"].append(weights["model.embed_tokens.weight"])
    kernels = {isa: kernel_build.load_gguf(isa) for isa in isas}
    if args.against:
        for isa in isas:
            kernels[f"{isa}@{args.against.name}"] = kernel_build._build(args.against.resolve(), "linear_gguf",
                                                                  kernel_build.gguf_flags(isa), ap.error)
    isas = list(kernels)
    if args.cpu_time:
        torch.set_num_threads(1)
    clock = time.process_time if args.cpu_time else time.perf_counter
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{torch.get_num_threads()} threads, {args.rounds} round(s), {'CPU' if args.cpu_time else 'wall'} time")
    for label, ws in groups.items():
        xs = {n: {w.inp: torch.randn(n, w.inp) for w in ws} for n in rows}
        times: dict[str, dict[int, list[float]]] = {isa: {n: [] for n in rows} for isa in isas}
        for _ in range(args.rounds):
            for isa, kernel in kernels.items():
                for n in rows:
                    times[isa][n].append(best_of_three(kernel, ws, xs[n], clock))
        mb = sum(w.nbytes for w in ws) / 1e6
        base = {n: statistics.median(times[isas[0]][n]) for n in rows}
        for isa in isas:
            med = {n: statistics.median(times[isa][n]) for n in rows}
            cells = [f"{n} rows {med[n] * 1e3:.1f} ms ({med[n] / med[rows[0]]:.2f}x" +
                     (f", {med[n] / base[n]:.2f} of {isas[0]})" if isa != isas[0] else ")") for n in rows]
            print(f"{label}, {isa}: {len(ws)} matrices, {mb:.0f} MB: " + "  ".join(cells))


if __name__ == "__main__":
    main()
