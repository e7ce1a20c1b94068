"""Which BLAS call shapes give a row the same bits whatever rows share the call: the
measurement behind ``kernels.linear_invariant_portable`` (docs/PERFORMANCE.md, "Design choices
and their measurements"). For each weight shape it compares every row of ``w @ x.T`` in calls of
1-33 rows, starting at a few offsets, with the row computed alone, both for one call per row
count and for calls of exactly 8 rows; then the same for attention's batched GEMM of query rows
against keys.

    python scripts/blas_invariance.py
"""

from __future__ import annotations

import torch


def one_call(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    pad = max(0, 8 - n)
    return (w @ torch.cat([x, x.new_zeros(pad, x.shape[1])]).T).T[:n]


def eight_row_calls(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    padded = torch.cat([x, x.new_zeros((-n) % 8, x.shape[1])])
    return torch.cat([(w @ c.T).T for c in padded.split(8)])[:n]


def differing(linear, w: torch.Tensor, x: torch.Tensor) -> list[tuple[int, int]]:
    alone = torch.cat([linear(x[i : i + 1], w) for i in range(x.shape[0])])
    return [(n, s) for n in range(1, 34) for s in (0, 1, 3)
            if not torch.equal(linear(x[s : s + n], w), alone[s : s + n])]


def main() -> None:
    torch.manual_seed(0)
    for shape in [(40, 24), (136, 96), (37, 1027), (4864, 896), (8960, 1536)]:
        w, x = torch.randn(*shape), torch.randn(40, shape[1])
        for name, linear in (("one call", one_call), ("8-row calls", eight_row_calls)):
            bad = differing(linear, w, x)
            print(f"{shape} {name}: {len(bad)} (rows, start) pairs differ, first {bad[:4]}")
    for keys in (50, 300):
        k, q = torch.randn(2, keys, 128), torch.randn(2, 64, 128)
        alone = torch.cat([torch.matmul(torch.cat([q[:, i : i + 1], q.new_zeros(2, 7, 128)], 1),
                                        k.transpose(1, 2))[:, :1] for i in range(64)], 1)
        bad = [(r, s) for r in range(8, 60) for s in (0, 1, 5)
               if not torch.equal(torch.matmul(q[:, s : s + r], k.transpose(1, 2)), alone[:, s : s + r])]
        print(f"attention scores, {keys} keys, 8-60 query rows: {len(bad)} differ")


if __name__ == "__main__":
    main()
