"""Time one forward of the draft model on its fast path (one SDPA call and a fused rms_norm per
layer) against the batch-invariant path the target needs, for a few row counts; for an int4
draft, its native whole forward (``Int4Draft``) against the same weights through torch layers.

The draft's numerics never affect exactness, so it may take whichever path is faster; this is the
measurement behind that choice (docs/PERFORMANCE.md). Both paths run in one process, alternating.

    python scripts/draft_step.py --rows 1,2,5
    python scripts/draft_step.py --quantize int4 --rows 1,2
    python scripts/draft_step.py --quantize int4 --rows 64,150 --repeat 5 --last-only  # a prefill: fused chunks of 32 rows
    python scripts/draft_step.py --quantize int4 --rows 1,2,5 --target qwen2.5-coder-1.5b-instruct

With ``--vocab``, it instead times the draft with its whole LM head against the same draft with
the head restricted to the N top-ranked tokens (``Decoder.restrict_vocabulary``), for each N,
alternating in one process:

    python scripts/draft_step.py --quantize int4 --rows 1 --vocab 8192,16384,32768,65536
    python scripts/draft_step.py --quantize int4 --rows 1 --vocab 65536 --target qwen2.5-coder-1.5b-instruct

With ``--requests``, it times one draft step of N requests at once (one row each, each its own
cache, as a server's batch drafts): an int4 draft's native forward of all of them
(``Int4Draft.forward_batch``) against the same rows through its torch layers, alternating:

    python scripts/draft_step.py --quantize int4 --requests 1,2,4,8
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from specdecode.drafters.draft_vocab import load_ranking
from specdecode.models.cache import KVCache
from specdecode.models.catalog import resolve_model
from specdecode.models.backends import TorchLayers
from specdecode.models.decoder import Decoder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--quantize", default="int8", choices=("int8", "int4", "none"))
    p.add_argument("--context", type=int, default=300, help="tokens in the cache before timing")
    p.add_argument("--rows", default="1,2,5")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--vocab", default=None, help="comma-separated head sizes N to time against the whole head")
    p.add_argument("--target", help="also time one step of this target (its GGUF run natively)")
    p.add_argument("--last-only", action="store_true",
                   help="time each call as a prompt's prefill or a catch-up runs: logits of its last row only")
    p.add_argument("--requests", help="comma-separated request counts: time one draft step of that many requests")
    args = p.parse_args()
    model = Decoder.from_dir(resolve_model(args.draft), role="draft",
                             quantize=None if args.quantize == "none" else args.quantize)
    cache = model.new_cache(args.context + max(int(r) for r in args.rows.split(",")))
    model.forward(torch.randint(0, 1000, (args.context,)), cache, last_only=True)
    target_step = None
    if args.target:
        target = Decoder.from_dir(resolve_model(args.target), quantize="native")
        target_cache = target.new_cache(args.context + 8)
        target.forward(torch.randint(0, 1000, (args.context,)), target_cache, last_only=True)

        def one_target_step() -> float:
            start = time.perf_counter()
            target.forward(torch.tensor([5]), target_cache)
            elapsed = time.perf_counter() - start
            target_cache.trim(1)
            return elapsed

        target_step = one_target_step

    if args.requests is not None:
        time_requests(model, [int(n) for n in args.requests.split(",")], args.context, args.repeat)
        return

    if args.vocab is not None:
        time_heads(model, cache, [int(n) for n in args.vocab.split(",")], args.rows, args.repeat, target_step)
        return

    if model.backend.fused is not None:  # int4: the native whole forward against torch's fast path
        names, slow = ("native forward", "torch layers"), model.with_backend(model.backend.layered())
    else:  # the same linear kernel with the target's attention and norm
        invariant = TorchLayers("target", model.config.rms_norm_eps, model.backend.linear)
        names, slow = ("fast path", "invariant path"), model.with_backend(invariant)

    def step(rows: int, fast: bool) -> float:
        start = time.perf_counter()
        (model if fast else slow).forward(torch.arange(rows) + 5, cache, last_only=args.last_only)
        elapsed = time.perf_counter() - start
        cache.trim(rows)
        return elapsed

    for rows in (int(r) for r in args.rows.split(",")):
        times: dict[bool | None, list[float]] = {True: [], False: [], None: []}
        for _ in range(args.repeat):
            for fast in (True, False):
                times[fast].append(step(rows, fast))
            if target_step is not None:
                times[None].append(target_step())
        fast_ms, exact_ms = (sorted(times[f])[args.repeat // 2] * 1e3 for f in (True, False))
        line = f"{rows} row(s): {names[0]} {fast_ms:.1f} ms, {names[1]} {exact_ms:.1f} ms"
        if target_step is not None:
            target_ms = sorted(times[None])[args.repeat // 2] * 1e3
            line += f"; target step {target_ms:.1f} ms: {names[0]} = {fast_ms / target_ms:.2f}x"
        print(line)


def time_requests(model: Decoder, counts: list[int], context: int, repeat: int) -> None:
    """Median time of one draft step of n requests (a row each, ``context`` tokens in each cache):
    through the native batched forward (where the draft has one) and through the torch layers."""
    slow = model.with_backend(model.backend.layered())
    for n in counts:
        caches = [model.new_cache(context + 8) for _ in range(n)]
        for i, cache in enumerate(caches):
            model.forward(torch.randint(0, 1000, (context,), generator=torch.Generator().manual_seed(i)), cache, last_only=True)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeat):
            for fast in (True, False):
                start = time.perf_counter()
                m = model if fast else slow
                if n == 1:  # a lone request's step: the forward a batch of one takes
                    m.forward(torch.tensor([5]), caches[0])
                else:
                    m.forward_batch([(torch.tensor([5]), c) for c in caches])
                times[fast].append(time.perf_counter() - start)
                for cache in caches:
                    cache.trim(1)
        native, layers = (sorted(times[f])[repeat // 2] * 1e3 for f in (True, False))
        print(f"{n} request(s): native forward {native:.1f} ms, torch layers {layers:.1f} ms")


def time_heads(model: Decoder, cache: KVCache, sizes: list[int], rows_list: str, repeat: int,
               target_step: Callable[[], float] | None = None) -> None:
    """Median (and least) step time of the whole head and of each restricted head, alternating per
    repeat; the least is the figure other processes on the machine disturb least. With
    ``target_step``, a target step too in each repeat, and each head's median against it."""
    ranking = load_ranking()
    heads = {"full": model} | {str(n): model.restrict_vocabulary(ranking.top(n)) for n in sizes}
    for rows in (int(r) for r in rows_list.split(",")):
        times: dict[str, list[float]] = {name: [] for name in heads}
        target: list[float] = []
        for _ in range(repeat):
            for name, m in heads.items():
                start = time.perf_counter()
                m.forward(torch.arange(rows) + 5, cache)
                times[name].append(time.perf_counter() - start)
                cache.trim(rows)
            if target_step is not None:
                target.append(target_step())
        median = {name: sorted(t)[repeat // 2] for name, t in times.items()}
        line = f"{rows} row(s), median (min): " + ", ".join(
            f"vocab {name} {median[name] * 1e3:.2f} ({min(t) * 1e3:.2f}) ms" for name, t in times.items())
        if target:
            target_s = sorted(target)[repeat // 2]
            line += f"; target step {target_s * 1e3:.1f} ms: " + ", ".join(
                f"vocab {name} = {median[name] / target_s:.2f}x" for name in heads)
        print(line)


if __name__ == "__main__":
    main()
