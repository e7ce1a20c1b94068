"""Time one prefill-sized float32 product (146 prompt rows x the 1.5B target's 1536 -> 8960 MLP
matrix) through MKL (what prefills use) and through oneDNN's prepacked linear, which needs a
second, blocked copy of the weight. The measurement behind the float32 target's prefill in
docs/PERFORMANCE.md: whether prefill could be faster without more memory.

    python scripts/prefill_gemm.py --rows 146
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.utils.mkldnn


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeat // 2] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=146, help="prompt tokens (default: %(default)s)")
    p.add_argument("--shape", default="8960x1536", metavar="OUTxIN")
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    out, inp = (int(v) for v in args.shape.lower().split("x"))
    w, x = torch.randn(out, inp), torch.randn(args.rows, inp)
    linear = torch.nn.Linear(inp, out, bias=False)
    linear.weight.data = w
    packed, xm = torch.utils.mkldnn.to_mkldnn(linear), x.to_mkldnn()
    gflop = 2 * args.rows * out * inp / 1e9
    for name, fn in (("MKL F.linear", lambda: torch.nn.functional.linear(x, w)),
                     ("oneDNN prepacked", lambda: packed(xm))):
        ms = median_ms(fn, args.repeat)
        print(f"{name}: {ms:.1f} ms, {gflop / ms * 1e3:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
