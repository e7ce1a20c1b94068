"""Time a native GGUF target's decode step, native whole forward against its layers and against
torch's small ops on the same weights, and its prefill rate.

    python scripts/native_steps.py [MODEL] [--context 256] [--rows 1,4,8] [--prefill 128]

The three variants run interleaved in one process (median of 8 each): "native" is what a GGUF
target runs (``backends.GGUFBackend``: its whole forward in one native call for up to 15 rows,
``gguf_forward.py``), "native layers" the same steps as one kernel call each from Python (the
same bits), "torch" the same GGUF matrix products with the norms, gate, residuals, RoPE and
attention as torch calls (``backends.TorchLayers`` around the GGUF kernel), which round
differently, so only the times are compared.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.api import LLM
from specdecode.models.backends import TorchLayers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--context", type=int, default=256, help="tokens in the cache before a step")
    ap.add_argument("--rows", default="1,4,8", help="rows per timed step")
    ap.add_argument("--prefill", type=int, default=128, help="prompt length of the timed prefill")
    args = ap.parse_args()
    llm = LLM(args.model, max_seq_len=max(1024, args.prefill + 16), progress=False)
    target, cache = llm.target, llm.engine.cache
    variants = {"native": target, "native layers": target.with_backend(target.backend.layered()),
                "torch": target.with_backend(TorchLayers("target", target.config.rms_norm_eps, target.backend.linear))}
    ids = list(range(1000, 1000 + args.context))
    cache.reset()
    target.forward(torch.tensor(ids), cache, last_only=True)

    def step(model, n: int) -> float:
        start = time.perf_counter()
        model.forward(torch.tensor(ids[-n:]), cache)
        elapsed = time.perf_counter() - start
        cache.trim(n)
        return elapsed

    for n in (int(r) for r in args.rows.split(",")):
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(8):
            for name, model in variants.items():
                step(model, n)
                times[name].append(step(model, n))
        shown = ", ".join(f"{name} {statistics.median(t) * 1e3:.1f} ms" for name, t in times.items())
        print(f"{n} row(s) after {args.context} tokens: {shown}")
    prompt = torch.randint(100, 50000, (args.prefill,), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    for _ in range(2):
        cache.reset()
        start = time.perf_counter()
        target.forward(prompt, cache, last_only=True)
        best = min(best, time.perf_counter() - start)
    print(f"prefill of {args.prefill} tokens (native): {best:.2f} s, {best / args.prefill * 1e3:.1f} ms a token")


if __name__ == "__main__":
    main()
