"""Where one decode step of the target goes: its GGUF matrix products, attention and RoPE kernels,
and everything else (norms, residuals and KV writes outside the kernels, Python), at a context.

    python scripts/step_parts.py [--model qwen2.5-coder-1.5b-instruct] [--context 256,1024] [--steps 20]

A step is one token after a prefill of ``context`` random tokens, then trimmed back, so every
timed step sees the same context. The parts come from the target's Python layers (each kernel
function wrapped with a timer for the run); the engine's own step, a GGUF target's native whole
forward (``gguf_forward.py``), runs the same kernels in one call and is timed beside them.
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
from specdecode.models.decoder import Decoder

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
    engine = LLM(args.model, method="none", progress=False).target
    layered = engine.with_backend(engine.backend.layered())
    token = torch.tensor([5])
    for context in (int(c) for c in args.context.split(",")):
        cache = engine.new_cache(context + 8)
        engine.forward(torch.randint(0, 1000, (context,)), cache, last_only=True, invariant=True)

        def step(model: Decoder) -> None:
            model.forward(token, cache, last_only=True, invariant=True)
            cache.length -= 1

        # Interleaved, so both see the same moments of the machine; the native forward calls no
        # wrapped function, so the parts count the layers' steps alone.
        models = {"layers": layered} if engine.backend.fused is None else {"engine": engine, "layers": layered}
        times = dict.fromkeys(models, 0.0)
        for _ in range(3):
            for model in models.values():
                step(model)
        seconds.clear()
        for _ in range(args.steps):
            for name, model in models.items():
                start = time.perf_counter()
                step(model)
                times[name] += time.perf_counter() - start
        total = times["layers"] / args.steps
        parts = {name: seconds[name] / args.steps for name in TIMED}
        cells = ", ".join(f"{name} {s * 1e3:.2f}" for name, s in parts.items())
        native = f"; the native forward's step {times['engine'] / args.steps * 1e3:.1f} ms" if "engine" in times else ""
        print(f"context {context}: step through the layers {total * 1e3:.1f} ms: {cells}, "
              f"the rest {(total - sum(parts.values())) * 1e3:.2f}{native}")


if __name__ == "__main__":
    main()
