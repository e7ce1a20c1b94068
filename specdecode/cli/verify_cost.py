"""``specdecode verify-cost``: how much one verify step of K drafts costs against one token.

Speculative decoding only pays if scoring K+1 tokens costs about one token's forward. This times
the target's forward for 1 row and for K+1 rows at the same context length and prints the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specdecode.cli.options import add_quantize_option
from specdecode.config import DEFAULT_DTYPE, DEFAULT_MODEL, DTYPES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="target model (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE)
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, action="append",
                   help="draft tokens per verify (repeatable; default: 1 3 7 8 11 15, i.e. 2, 4, 8, 9, 12 "
                        "and 16 rows)")
    add_quantize_option(p)
    p.add_argument("--context", type=int, default=256, help="tokens already in the cache (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions, median reported (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from specdecode.api import target_quantize
    from specdecode.models.catalog import resolve_model
    from specdecode.models.decoder import Decoder

    path = resolve_model(args.model, progress=not args.json)
    quantize = target_quantize(args.quantize, args.dtype, path)
    model = Decoder.from_dir(path, args.dtype, quantize=quantize)
    # The same float weights through torch's own F.linear (BLAS GEMV for one row): the reference
    # speed for one token, which rounds differently from multi-row calls (see models/kernels.py).
    gemv = Decoder.from_dir(path, args.dtype, role="draft", native=False) if quantize is None else None
    ks = args.k or [1, 3, 7, 8, 11, 15]
    cache = model.new_cache(args.context + max(ks) + 2)
    prompt = torch.randint(0, model.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    model.forward(prompt, cache, last_only=True)

    def timed(rows: int, decoder: Decoder = model) -> float:
        samples = []
        for _ in range(args.repeat + 1):  # the first run warms up
            t = time.perf_counter()
            decoder.forward(prompt[:rows], cache)
            samples.append(time.perf_counter() - t)
            cache.trim(rows)
        return statistics.median(samples[1:])

    one = timed(1)
    result = {"model": args.model, "dtype": args.dtype, "quantize": quantize or "none", "context": args.context,
              "one_token_s": one, "one_token_gemv_s": timed(1, gemv) if gemv is not None else None,
              "verify": {k: {"rows": k + 1, "seconds": (s := timed(k + 1)), "ratio": s / one} for k in ks}}
    if args.json:
        print(json.dumps(result))
        return 0
    gemv_note = (f"; torch F.linear, not batch-invariant: {result['one_token_gemv_s'] * 1e3:.1f} ms"
                 if gemv is not None else "")
    print(f"{args.model} ({args.dtype}, {result['quantize']} weights), context {args.context}: one token "
          f"{one * 1e3:.1f} ms (batch-invariant path{gemv_note})")
    for k, r in result["verify"].items():
        print(f"  verify K={k:<2} ({r['rows']} rows): {r['seconds'] * 1e3:7.1f} ms = {r['ratio']:.2f}x one token")
    return 0
