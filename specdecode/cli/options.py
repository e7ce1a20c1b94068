"""Flags shared by several subcommands, declared once so their names, defaults and help agree."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdecode.config import (DEFAULT_DRAFT_CONFIDENCE, DEFAULT_DRAFT_QUANTIZE, DEFAULT_DRAFT_VOCAB, DEFAULT_MODEL,
                               DEFAULT_SPECULATIVE_TOKENS, DRAFT_QUANTIZE_CHOICES, LOOKAHEAD_CANDIDATES, LOOKAHEAD_NGRAM,
                               LOOKAHEAD_WINDOW, default_method)
from specdecode.drafters.registry import METHOD_NAMES, method_help

if TYPE_CHECKING:
    from specdecode.api import LLM

METHOD_HELP = method_help()
log = logging.getLogger("specdecode.cli")


def add_method_flag(p: argparse.ArgumentParser, k_help: str) -> None:
    """``--method`` and ``-k`` for commands that run one method (generate, serve)."""
    p.add_argument("--method", choices=METHOD_NAMES, default=None,
                   help=METHOD_HELP + " (default: combined with a draft model, i.e. with the default target or "
                                      "--draft; else suffix)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=DEFAULT_SPECULATIVE_TOKENS, dest="k",
                   help=k_help + " (default: %(default)s)")


def chosen_method(args: argparse.Namespace) -> str:
    """``--method``, or the default for ``--model`` and ``--draft`` (``config.default_method``)."""
    return args.method or default_method(args.model, args.draft)


def add_model_options(p: argparse.ArgumentParser) -> None:
    """``--model`` and ``--draft`` for commands that load the pair themselves (generate, serve)."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="target: a catalog name (see `specdecode models list`), a local HF folder, "
                        "a .gguf file or a hub id (default: %(default)s)")
    p.add_argument("--draft", default=None,
                   help="draft model for --method draft_model/combined (same vocabulary as the target); "
                        "defaults to the catalog's pair for the default target")


def add_quantize_option(p: argparse.ArgumentParser) -> None:
    """``--quantize`` for the target (generate, serve, bench)."""
    p.add_argument("--quantize", choices=("native", "none", "int8"), default=None,
                   help="how the target's weights run: native runs a GGUF model's quantized weights as "
                        "shipped through integer kernels (the default for GGUF sources, every catalog "
                        "model); none runs them dequantized to float (the default for HF folders); int8 "
                        "gives float32 weights per-row int8 scales. Each is a slightly different model, "
                        "and every method is exact with respect to the one chosen (what --method none runs)")


def add_prefix_cache_options(p: argparse.ArgumentParser) -> None:
    """``--no-prefix-cache`` and ``--kv-cache-memory`` (serve, bench)."""
    p.add_argument("--no-prefix-cache", action="store_false", dest="prefix_cache",
                   help="prefill every prompt whole: keep no request's KV cache for later prompts that start "
                        "the same way (the cache is on by default; output is bitwise the same either way)")
    p.add_argument("--kv-cache-memory", type=kv_memory_arg, default=None, metavar="SIZE",
                   help="memory all requests' KV caches may take, running and kept for reuse, e.g. 2GiB or "
                        "512MiB; least recently used kept caches are evicted first, and a request that still "
                        "does not fit is refused (HTTP 503) rather than crash the process (default: a quarter "
                        "of this machine's memory, leaving the rest to the weights, the OS and other work)")


def add_prefix_cache_file_option(p: argparse.ArgumentParser, when: str) -> None:
    """``--prefix-cache-file PATH`` (serve, generate); ``when``: when this command reads and writes it."""
    p.add_argument("--prefix-cache-file", type=Path, default=None, metavar="PATH",
                   help=f"keep the prefix cache's kept prompts (their KV caches) in this file across runs, so a "
                        f"long system prompt or document is prefilled once: {when}. The file records the model's "
                        "weights, dtype, quantization and this build's numerics, and is used only where all of "
                        "them match (output stays bitwise that of an uncached run); a missing, damaged or "
                        "mismatched file is reported and the cache starts empty (default: none)")


def restore_prefix_cache(llm: LLM, path: Path | None) -> bool:
    """Load ``path`` into ``llm``'s prefix cache when it exists; whether it did. A file that
    cannot be used is warned about and skipped, never fatal: it only saves time."""
    from specdecode.errors import PrefixCacheFileError

    if path is None or not path.exists():
        return False
    try:
        tokens = llm.load_prefix_cache(path)
    except PrefixCacheFileError as exc:
        log.warning(f"specdecode: warning: not restoring the prefix cache: {exc}; starting with an empty one")
        return False
    log.info(f"specdecode: restored {tokens} kept prompt tokens from {path}")
    return True


def save_prefix_cache(llm: LLM, path: Path | None) -> None:
    """Write ``llm``'s kept prefixes to ``path``; a failure is warned about, not fatal (the run's
    own output is already out)."""
    from specdecode.errors import PrefixCacheFileError

    if path is None:
        return
    try:
        tokens = llm.save_prefix_cache(path)
    except PrefixCacheFileError as exc:
        log.warning(f"specdecode: warning: the prefix cache was not saved: {exc}")
        return
    log.info(f"specdecode: saved {tokens} kept prompt tokens to {path}")


def kv_memory_arg(text: str) -> int:
    """A ``--kv-cache-memory`` value in bytes, or an argparse error naming the forms accepted."""
    from specdecode.models.prefix_cache import parse_memory
    from specdecode.errors import InvalidConfigError

    try:
        return parse_memory(text)
    except InvalidConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def draft_vocab_arg(text: str) -> int | None:
    """``--draft-vocab``: "auto" -> None (the default size), "full" -> 0 (the whole head), else N >= 0."""
    word = text.strip().lower()
    if word in ("auto", "full"):
        return None if word == "auto" else 0
    try:
        size = int(word)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count, full or auto, got {text!r}") from None
    if size < 0:
        raise argparse.ArgumentTypeError(f"expected a token count >= 0, got {size}")
    return size


def non_negative_float(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_draft_options(p: argparse.ArgumentParser, fixed_k: bool = True) -> None:
    """How the draft model drafts: ``--draft-quantize``, ``--draft-confidence``, ``--draft-vocab``
    and (unless the command has its own K schedule) ``--fixed-k``."""
    if fixed_k:
        p.add_argument("--fixed-k", action="store_true",
                       help="draft up to K every step instead of the length the speculation policy picks "
                            "from measured costs and acceptance (0 included); the draft model still stops "
                            "early by --draft-confidence (0 there: exactly K)")
    p.add_argument("--draft-confidence", type=float, default=DEFAULT_DRAFT_CONFIDENCE,
                   help="with --fixed-k, a draft model stops drafting once its probability for its draft "
                        "so far (the product of its token probabilities) falls below this; 0 never stops "
                        "early (default: %(default)s). Otherwise the speculation policy sets this stop "
                        "each step from measured costs")
    p.add_argument("--draft-quantize", choices=DRAFT_QUANTIZE_CHOICES, default=DEFAULT_DRAFT_QUANTIZE,
                   help="draft weights: int4 (4-bit weights and one native call per draft step, on "
                        "x86 CPUs with AVX2; else int8), int8 (cheaper drafts than float) or none "
                        "(the --dtype; trained heads too, which draft in 4 bits otherwise); the output stays "
                        "exactly the target's either way "
                        "(default: %(default)s)")
    p.add_argument("--draft-temperature", type=non_negative_float, default=None, metavar="T",
                   help="how the draft model drafts for sampled requests (temperature > 0): 0 proposes its "
                        "argmax, T > 0 samples at temperature T; by default it samples by the request's own "
                        "settings. The output stays exactly the target's sample either way; only acceptance changes")
    p.add_argument("--draft-vocab", type=draft_vocab_arg, default=None, metavar="N",
                   help="draft model: its LM head computes the logits of only the N tokens the target writes most "
                        f"(a ranking shipped for the Qwen2.5 tokenizer); full (or 0) keeps the whole head; auto (the "
                        f"default) is {DEFAULT_DRAFT_VOCAB} when the ranking matches the draft's tokenizer, else "
                        "full. The output stays exactly the target's")


def add_method_options(p: argparse.ArgumentParser) -> None:
    """Options of the methods that need no draft model: suffix's datastore, lookahead's window,
    the trained heads of eagle and medusa."""
    p.add_argument("--datastore", default=None, metavar="STORE",
                   help="--method suffix: also draft from this datastore (made by `specdecode index "
                        "build`); without it suffix drafts from the prompt and earlier requests")
    p.add_argument("--lookahead-window", type=int, default=LOOKAHEAD_WINDOW, metavar="W",
                   help="--method lookahead: positions guessed ahead in parallel (default: %(default)s)")
    p.add_argument("--lookahead-ngram", type=int, default=LOOKAHEAD_NGRAM, metavar="N",
                   help="--method lookahead: n-gram size; N - 1 Jacobi levels are kept and each "
                        "verified guess has N - 1 tokens (default: %(default)s)")
    p.add_argument("--lookahead-candidates", type=int, default=LOOKAHEAD_CANDIDATES, metavar="G",
                   help="--method lookahead: n-grams verified per step (default: %(default)s)")
    p.add_argument("--eagle-head", default=None, metavar="DIR",
                   help="--method eagle: an EAGLE-3 head for the target (SpecForge or vLLM speculators "
                        "layout), e.g. one made by `specdecode train eagle3`")
    p.add_argument("--medusa-heads", default=None, metavar="DIR",
                   help="--method medusa: Medusa heads for the target (vLLM's or FasterDecoding's layout), "
                        "e.g. made by `specdecode train medusa`")
    p.add_argument("--head-tree-width", type=int, default=0, metavar="W",
                   help="--method eagle and medusa: 0 drafts a chain; W > 0 drafts a token tree of at most K nodes, "
                        "expanding the W most probable paths by their W most probable tokens (default: "
                        "%(default)s)")


def command_line(parser: argparse.ArgumentParser, args: argparse.Namespace, always: Sequence[str] = (),
                 leave_out: Sequence[str] = ()) -> list[str]:
    """The options of ``args`` as the user would type them, read from ``parser``'s own actions so
    that a new flag can never be missing: each one whose value differs from its default, and those
    named in ``always`` (destinations) unless another flag of their mutually exclusive group is
    written. ``leave_out`` names destinations that do not change what runs (an output folder)."""
    chosen = [a for a in parser._actions if a.option_strings and a.dest not in leave_out
              and a.default is not argparse.SUPPRESS
              and getattr(args, a.dest, a.default) != a.default]
    for group in parser._mutually_exclusive_groups:
        rivals = [a for a in group._group_actions if a in chosen]
        chosen += [a for a in group._group_actions if a.dest in always and not rivals]
    chosen += [a for a in parser._actions if a.dest in always and a not in chosen
               and not any(a in g._group_actions for g in parser._mutually_exclusive_groups)]
    words: list[str] = []
    for action in sorted(chosen, key=parser._actions.index):
        value, flag = getattr(args, action.dest, action.default), action.option_strings[0]
        if action.nargs == 0:  # store_true and the like: the flag is the value
            words.append(flag)
        elif str(value).startswith("-"):  # an argument that looks like a flag, e.g. --llamacpp-args '-ngl 9'
            words.append(f"{flag}={value}")
        else:
            words += [flag, str(value)]
    return words


def method_options(args: argparse.Namespace, methods: Sequence[str]) -> dict[str, Any]:
    """``LLM`` keyword arguments from the flags of ``add_method_options``; says so when
    ``--datastore`` is given but none of ``methods`` (the ones this command runs) reads it."""
    if args.datastore and "suffix" not in methods:
        print("specdecode: note: --datastore is used by --method suffix only; it is ignored here",
              file=sys.stderr)
    for flag, method in (("eagle_head", "eagle"), ("medusa_heads", "medusa")):
        if getattr(args, flag) and method not in methods:
            print(f"specdecode: note: --{flag.replace('_', '-')} is used by --method {method} only; it is ignored "
                  "here", file=sys.stderr)
    return dict(datastore=args.datastore, lookahead_window=args.lookahead_window,
                lookahead_ngram=args.lookahead_ngram, lookahead_candidates=args.lookahead_candidates,
                eagle_head=args.eagle_head if "eagle" in methods else None,
                medusa_heads=args.medusa_heads if "medusa" in methods else None, head_tree_width=args.head_tree_width)
