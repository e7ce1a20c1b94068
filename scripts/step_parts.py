"""Where one decode step of the target goes: its GGUF matrix products, attention and RoPE kernels,
and everything else (norms, residuals and KV writes outside the kernels, Python), at a context.

    python scripts/step_parts.py [--model qwen2.5-coder-1.5b-instruct] [--context 256,1024] [--steps 20]

Each kernel function is wrapped with a timer for the run; a step is one token on the
batch-invariant path the engine takes, after a prefill of ``context`` random tokens, and is
then trimmed back, so every timed step sees the same context.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch

from specdecode.api import LLM
from specdecode.models import kernels

TIMED = ("linear_gguf", "attention_rows", "rope_qkv")


def timed(seconds: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="(default: %(default)s)")
    ap.add_argument("--context", default="256,1024", help="tokens in the cache, comma-separated (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per context (default: %(default)s)")
    args = ap.parse_args()
    seconds: dict[str, float] = collections.defaultdict(float)
    for name in TIMED:
        setattr(kernels, name, timed(seconds, name, getattr(kernels, name)))
    target = LLM(args.model, method="none", progress=False).target
    token = torch.tensor([5])
    for context in (int(c) for c in args.context.split(",")):
        cache = target.new_cache(context + 8)
        target.forward(torch.randint(0, 1000, (context,)), cache, last_only=True, invariant=True)

        def step() -> None:
            target.forward(token, cache, last_only=True, invariant=True)
            cache.length -= 1

        for _ in range(3):
            step()
        seconds.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        total = (time.perf_counter() - start) / args.steps
        parts = {name: seconds[name] / args.steps for name in TIMED}
        cells = ", ".join(f"{name} {s * 1e3:.2f}" for name, s in parts.items())
        print(f"context {context}: step {total * 1e3:.1f} ms: {cells}, the rest {(total - sum(parts.values())) * 1e3:.2f}")


if __name__ == "__main__":
    main()
