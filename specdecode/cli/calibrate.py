"""``specdecode calibrate``: choose the layers self-speculation (``--method self``) skips.

Generates the target's greedy continuation of a few prompts, searches a skip set by teacher-forced
agreement (see ``drafters/self_spec/calibrate.py``), prints it and stores it next to the model as
``specdecode-self.json``, where ``--method self`` finds it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdecode.drafters.self_spec.layers import (DEFAULT_CALIBRATION_K, DEFAULT_CALIBRATION_TOKENS, DEFAULT_CANDIDATES,
                                               DEFAULT_MAX_SKIP)
from specdecode.config import DEFAULT_MODEL
from specdecode.errors import InvalidConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="target: a catalog name, a local HF folder, a .gguf file or a hub id (default: %(default)s)")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="calibration prompts: a text file with one prompt per line, or a .jsonl file of "
                        "objects with a \"prompt\" field (default: a few built-in chat and code prompts)")
    p.add_argument("--num-prompts", type=int, default=None, metavar="N",
                   help="use only the first N prompts (default: all)")
    p.add_argument("--raw", action="store_true",
                   help="feed prompts as raw text instead of user messages in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS, metavar="N",
                   help="tokens of the target's greedy continuation scored per prompt (default: %(default)s)")
    p.add_argument("--k", type=int, default=DEFAULT_CALIBRATION_K,
                   help="draft length the speed estimate assumes (default: %(default)s)")
    p.add_argument("--max-skip", type=float, default=DEFAULT_MAX_SKIP, metavar="FRACTION",
                   help="skip at most this fraction of the layers, in (0, 1) (default: %(default)s)")
    p.add_argument("--candidates", type=int, default=DEFAULT_CANDIDATES, metavar="N",
                   help="after the first round (which tries every layer), try only the N layers that "
                        "scored best so far; 0 tries every layer every round, exact greedy but quadratic "
                        "in the layer count (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    p.add_argument("--output", type=Path, default=None, metavar="PATH",
                   help="where to write the JSON result (default: specdecode-self.json in the model's folder, "
                        "where --method self looks for it)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specdecode.drafters.self_spec.calibrate import BUILTIN_PROMPTS, calibrate, encode_prompts, greedy_continuation, max_skipped
    from specdecode.models.catalog import resolve_model
    from specdecode.models.decoder import Decoder
    from specdecode.drafters.self_spec.layers import save_skip, skip_file
    from specdecode.tokenizer import Tokenizer

    if args.num_prompts is not None and args.num_prompts < 1:
        raise InvalidConfigError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.max_tokens < 1:
        raise InvalidConfigError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.candidates < 0:
        raise InvalidConfigError(f"--candidates must be 0 (all layers) or more, got {args.candidates}")
    prompts = read_prompts(args.prompts) if args.prompts is not None else list(BUILTIN_PROMPTS)
    prompts = prompts[: args.num_prompts]
    progress = not args.no_progress
    path = resolve_model(args.model, progress=progress)
    tokenizer = Tokenizer.from_dir(path)
    target = Decoder.from_dir(path)
    max_skipped(target.config.num_layers, args.k, args.max_skip)  # refuse bad settings before the slow part
    ids = encode_prompts(tokenizer, prompts, chat=not args.raw)
    samples = [greedy_continuation(target, p, args.max_tokens, tokenizer.eos_token_ids)
               for p in tqdm(ids, desc="target continuations", unit="prompt", file=sys.stderr, disable=not progress)]
    choice, history = calibrate(target, path, samples, args.k, args.max_skip, progress, args.candidates)
    for step in history:
        print(f"skip {len(step.skip):>3} layers: alpha {step.alpha:.3f}, estimated speedup {step.speedup:.2f}x")
    out = save_skip(choice, args.output if args.output is not None else skip_file(path))
    print(f"chosen: skip layers {choice.skip} of {choice.num_layers} (alpha {choice.alpha:.3f} over "
          f"{choice.tokens} tokens; estimated speedup {choice.estimated_speedup:.2f}x at K={choice.k}, "
          f"best K {choice.best_k})")
    if choice.estimated_speedup <= 1.0:
        print("note: no skip set is estimated to beat plain decoding on this model", file=sys.stderr)
    print(f"wrote {out}")
    return 0


def read_prompts(path: Path) -> list[str]:
    """Prompts from a text file (one per non-blank line) or a JSONL file (a "prompt" per object)."""
    try:
        numbered = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    except OSError as exc:
        raise InvalidConfigError(f"cannot read --prompts {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise InvalidConfigError(f"--prompts {path} is not UTF-8 text") from None
    if path.suffix == ".jsonl":
        lines = [_jsonl_prompt(path, number, line) for number, line in numbered]
    else:
        lines = [line for _, line in numbered]
    if not lines:
        raise InvalidConfigError(f"--prompts {path} holds no prompt")
    return lines


def _jsonl_prompt(path: Path, number: int, line: str) -> str:
    try:
        prompt = json.loads(line)["prompt"]
    except (ValueError, KeyError, TypeError):
        raise InvalidConfigError(f"{path} line {number}: expected a JSON object with a \"prompt\" string") from None
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidConfigError(f"{path} line {number}: \"prompt\" must be a non-empty string")
    return prompt
