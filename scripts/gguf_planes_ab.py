"""Time a previous GGUF kernel on the planes it was written for against the current kernel on the
current planes, when a change alters both (``gguf_planes.REPACK_VERSION``), and check that both
give the same bits.

    git show OLD:specdecode/models/csrc/linear_gguf.cpp > /tmp/old/linear_gguf.cpp
    cp specdecode/models/csrc/lanes.h /tmp/old/
    python scripts/gguf_planes_ab.py OLD_PLANES.safetensors /tmp/old/linear_gguf.cpp [--rows 1,5,9]

OLD_PLANES is a plane cache the previous version wrote under ``$SPECDECODE_HOME/native/`` (it
stays there after a version change). Every quantized matrix but the embedding table is multiplied
(one decode step's weight part), the two sides alternating within each of ``--rounds`` rounds; a
round keeps the best of three passes and each line prints the medians. The kernel build is the
one models use here (``SPECDECODE_GGUF_ISA`` chooses another).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from safetensors import safe_open

from specdecode.models import gguf_load, kernel_build
from specdecode.models.catalog import CATALOG, find_weight_files
from specdecode.models.gguf_planes import GGUFWeight


def matrices(weights: dict) -> dict[str, GGUFWeight]:
    return {n: w for n, w in weights.items() if isinstance(w, GGUFWeight) and n != "model.embed_tokens.weight"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old_planes", type=Path, help="a plane cache written by the previous version")
    ap.add_argument("old_kernel", type=Path, help="the previous linear_gguf.cpp (with lanes.h beside it)")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="catalog model (default: %(default)s)")
    ap.add_argument("--rows", default="1,5,9", help="row counts (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds (default: %(default)s)")
    args = ap.parse_args()
    with safe_open(args.old_planes, framework="pt") as f:
        old_version = f.metadata().get("repack_version")
    isa = kernel_build.gguf_isa()
    sides = {
        f"old (planes v{old_version})": (kernel_build._build(args.old_kernel.resolve(), "linear_gguf",
                                                             kernel_build.gguf_flags(isa), ap.error),
                                          matrices(gguf_load._read(args.old_planes))),
        "new": (kernel_build.load_gguf(isa),
                matrices(gguf_load.native_weights(find_weight_files(CATALOG[args.model])))),
    }
    if len({frozenset(ws) for _, ws in sides.values()}) != 1:
        ap.error("the two plane sets hold different matrices: are they of the same model?")
    for name, (_, ws) in sides.items():
        print(f"{name}: {len(ws)} matrices, {sum(w.nbytes for w in ws.values()) / 1e6:.0f} MB")
    rows = [int(r) for r in args.rows.split(",")]
    xs = {r: {w.inp: torch.randn(r, w.inp) for w in sides["new"][1].values()} for r in rows}
    times: dict[tuple[str, int], list[float]] = {(name, r): [] for name in sides for r in rows}
    for _ in range(args.rounds):
        for name, (kernel, ws) in sides.items():
            for r in rows:
                best = float("inf")
                for _ in range(3):
                    start = time.perf_counter()
                    for w in ws.values():
                        kernel.linear_gguf(xs[r][w.inp], [w.part])
                    best = min(best, time.perf_counter() - start)
                times[(name, r)].append(best)
    old_name = next(iter(sides))
    for r in rows:
        old, new = statistics.median(times[(old_name, r)]), statistics.median(times[("new", r)])
        print(f"{isa}, {r} rows: old {old * 1e3:.1f} ms, new {new * 1e3:.1f} ms, new / old {new / old:.3f}")
    (old_kernel, old_ws), (new_kernel, new_ws) = sides[old_name], sides["new"]
    checked = list(new_ws)[:8]
    same = all(torch.equal(old_kernel.linear_gguf(x, [old_ws[n].part]), new_kernel.linear_gguf(x, [new_ws[n].part]))
               for n in checked for x in [torch.randn(3, new_ws[n].inp)])
    print(f"outputs bitwise equal on {len(checked)} matrices, 3 rows: {'yes' if same else 'NO'}")

if __name__ == "__main__":
    main()
