"""A/B two versions of the native linear kernel on the real target's weights.

Per row count, it times one pass over every linear weight of the model (what a decode or verify
step reads), alternating between the versions so that drifts of this machine's speed hit both
alike, and reports the median of ``--repeat`` passes. It first checks that the versions give
bit-identical outputs, since a kernel change must not change numerics unless intended.

    git show HEAD~1:specdecode/models/csrc/linear_rows.cpp > /tmp/old.cpp
    python scripts/kernel_ab.py /tmp/old.cpp specdecode/models/csrc/linear_rows.cpp --rows 1,2,3,5,9
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from specdecode.models.catalog import resolve_model
from specdecode.models import kernel_build
from specdecode.models.decoder import Decoder


def build(source: Path, root: Path, flags: list[str]):
    digest = hashlib.sha256(source.read_bytes() + str(flags).encode()).hexdigest()[:12]
    folder = root / digest
    folder.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name=f"kernel_ab_{digest}", sources=[str(source)], build_directory=str(folder),
                              extra_cflags=flags, extra_ldflags=["-fopenmp"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sources", nargs="+", type=Path, help="kernel .cpp files to compare")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--rows", default="1,2,3,5,9", help="comma-separated row counts (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=5, help="timed passes per version and row count")
    p.add_argument("--int8", action="store_true",
                   help="time linear_rows_int8 on int8 copies of the weights (what --quantize int8 runs)")
    p.add_argument("--avx2", action="store_true",
                   help="build with AVX2/FMA only, even on a CPU with AVX-512 (the default follows the CPU)")
    p.add_argument("--shape", default=None, metavar="OUTxIN",
                   help="time one random float32 matrix of this shape instead of the model's weights, "
                        "and print GFLOP/s too (e.g. 8192x1536: whether rows are bound by memory or compute)")
    p.add_argument("--build-dir", type=Path, default=Path("/tmp/specdecode-kernel-ab"))
    args = p.parse_args()
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp"] if args.avx2 else kernel_build.compile_flags()
    kernels = {str(s): build(s, args.build_dir, flags) for s in args.sources}
    if args.shape:
        out, inp = (int(v) for v in args.shape.lower().split("x"))
        weights = [torch.randn(out, inp) for _ in range(3)]
    else:
        model = Decoder.from_dir(resolve_model(args.model), quantize="int8" if args.int8 else None)
        weights = [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        weights.append(model.lm_head)
    if args.int8 and not args.shape:
        for kernel in kernels.values():
            kernel.linear_rows = (lambda k: lambda x, w: k.linear_rows_int8(x, w.q, w.scale))(kernel)
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        first = [k.linear_rows(xs[weights[2].shape[1]], weights[2]) for k in kernels.values()]
        same = all(torch.equal(f, first[0]) for f in first)
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(args.repeat):
            for name, kernel in kernels.items():
                start = time.perf_counter()
                for w in weights:
                    kernel.linear_rows(xs[w.shape[1]], w)
                times[name].append(time.perf_counter() - start)
        flops = 2 * rows * sum(w.numel() for w in weights)
        medians = ", ".join(f"{name}: {_median(t) * 1e3:.2f} ms" + (f" ({flops / _median(t) / 1e9:.0f} GFLOP/s)"
                                                                   if args.shape else "")
                            for name, t in times.items())
        print(f"{rows} row(s): {medians}; bit-identical: {same}")


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


if __name__ == "__main__":
    main()
