"""``specdecode export vllm``: write a folder that ``vllm serve`` runs as it is (see
``specdecode.export.vllm`` for the layout and docs/SCALING.md for the proof it runs)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from specdecode.drafters.registry import METHOD_NAMES
from specdecode.export.choices import DEFAULT_VLLM_K, EXPORT_DTYPES, NEAREST, VLLM_METHODS

EPILOG = """\
Methods: none, ngram, draft_model, eagle (vLLM's eagle3), medusa and suffix have vLLM counterparts;
lookahead, self, combined and tree do not and are refused with the nearest vLLM method named.
A draft of another vocabulary is exported with vLLM's use_heterogeneous_vocab.

Then: OUT/serve.sh [--tensor-parallel-size N] [any other `vllm serve` flag]
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="engine", required=True, metavar="ENGINE")
    v = sub.add_parser("vllm", help="a folder vLLM serves: the target and drafter as safetensors, "
                                    "speculative_config.json and serve.sh",
                       description="Export the target, its drafter and the speculative settings as files "
                                   "`vllm serve` runs unchanged, on one machine or with tensor parallelism.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("--model", default=None,
                   help="target: catalog name, HF folder, .gguf file or hub id (default: the bench run's with "
                        "--from-bench, else the default target)")
    v.add_argument("--method", default=None, choices=METHOD_NAMES, metavar="METHOD",
                   help="the method to hand over (default: the bench advice with --from-bench, eagle with "
                        "--eagle-head, medusa with --medusa-heads, else draft_model); "
                        f"vLLM has {', '.join(VLLM_METHODS)}, not {', '.join(NEAREST)}")
    v.add_argument("--draft", default=None,
                   help="the draft model for draft_model (default: the bench run's, else the target's default "
                        "draft)")
    v.add_argument("--eagle-head", default=None, metavar="DIR",
                   help="an EAGLE-3 head folder (from `specdecode train eagle3` or any SpecForge/speculators "
                        "head for this target); written in vLLM's speculators format")
    v.add_argument("--medusa-heads", default=None, metavar="DIR",
                   help="a Medusa heads folder (from `specdecode train medusa`); K defaults to its number of heads")
    ks = v.add_mutually_exclusive_group()
    ks.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=None,
                    help=f"draft tokens per step; vLLM's K is fixed (default: {DEFAULT_VLLM_K}, or the number "
                         "of Medusa heads)")
    ks.add_argument("--from-bench", type=Path, default=None, metavar="DIR",
                    help="a `specdecode bench --out DIR` folder: hand over its advised method (unless --method) "
                         "at the K that served it best there")
    v.add_argument("--dtype", choices=EXPORT_DTYPES, default=None,
                   help="weights dtype written and served (default: as stored; float32 for catalog models, "
                        "what specdecode's outputs are compared in)")
    v.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="the --tensor-parallel-size serve.sh passes (default: %(default)s); "
                        "`serve.sh --tensor-parallel-size N` overrides it at run time")
    v.add_argument("--out", type=Path, required=True,
                   help="the folder to write (new, empty, or an earlier export, which is replaced whole)")
    v.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    v.set_defaults(run=run_vllm)


def run_vllm(args: argparse.Namespace) -> int:
    from specdecode.export.plan import plan_export
    from specdecode.export.vllm import write_export

    progress = not args.no_progress
    plan = plan_export(model=args.model, method=args.method, draft=args.draft, eagle_head=args.eagle_head,
                       medusa_heads=args.medusa_heads, k=args.k, from_bench=args.from_bench, dtype=args.dtype,
                       tensor_parallel_size=args.tensor_parallel_size, progress=progress)
    out = write_export(plan, args.out, _command(args), progress)
    print(f"exported {plan.method}" + (f" (vLLM {plan.vllm_method}, K={plan.k})" if plan.vllm_method else "")
          + f" to {out}", file=sys.stderr)
    print(f"run: {shlex.quote(str(out / 'serve.sh'))} [--tensor-parallel-size N]")
    return 0


def _command(args: argparse.Namespace) -> str:
    parts = ["specdecode", "export", "vllm"]
    for flag, value in (("--model", args.model), ("--method", args.method), ("--draft", args.draft),
                        ("--eagle-head", args.eagle_head), ("--medusa-heads", args.medusa_heads), ("-k", args.k),
                        ("--from-bench", args.from_bench), ("--dtype", args.dtype)):
        if value is not None:
            parts += [flag, str(value)]
    if args.tensor_parallel_size != 1:
        parts += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    return shlex.join([*parts, "--out", str(args.out)])
