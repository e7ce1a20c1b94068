"""``specdecode train eagle3|medusa|distill``: train a drafter for a target on the user's own data.

Every trainer shares its data, budget and checkpoint flags (``_common``); see ``train/jobs.py``
for what the output folder holds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdecode.config import DEFAULT_MODEL
from specdecode.errors import InvalidConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trainer", required=True, metavar="KIND")
    eagle = sub.add_parser("eagle3", help="an EAGLE-3 head on the target's hidden states (--method eagle)",
                           description="Train an EAGLE-3 head: one decoder layer reading three of the target's "
                                       "layers, saved in the SpecForge layout that SGLang and vLLM load.")
    _common(eagle)
    eagle.add_argument("--draft-vocab-size", type=int, default=32000, metavar="N",
                       help="tokens the head predicts: the N the target predicts most on the data (default: "
                            "%(default)s, SpecForge's; capped at the target's vocabulary)")
    eagle.add_argument("--intermediate-size", type=int, default=None, metavar="N",
                       help="the head's MLP width (default: the target's; smaller drafts faster and trains "
                            "faster)")
    eagle.add_argument("--ttt-steps", type=int, default=7, metavar="N",
                       help="draft steps unrolled per training example (EAGLE-3's training-time test; "
                            "default: %(default)s)")
    eagle.add_argument("--format", choices=("specforge", "speculators"), default="specforge",
                       help="folder layout: SpecForge/EAGLE (SGLang, vLLM) or vLLM's speculators "
                            "(default: %(default)s); specdecode loads both")
    eagle.set_defaults(run=run_eagle3)
    medusa = sub.add_parser("medusa", help="Medusa heads on the target's last hidden state (--method medusa)",
                            description="Train Medusa-1 heads (residual blocks on the target's final hidden state, "
                                        "head k guessing the token k + 2 ahead), saved in vLLM's Medusa layout.")
    _common(medusa)
    medusa.add_argument("--num-heads", type=int, default=4, metavar="N",
                        help="heads, the most tokens drafted per step (default: %(default)s)")
    medusa.add_argument("--num-layers", type=int, default=1, metavar="N",
                        help="residual blocks per head (default: %(default)s)")
    medusa.add_argument("--vocab-size", type=int, default=32000, metavar="N",
                        help="tokens the heads predict: the N the target predicts most on the data (vLLM's "
                             "truncated_vocab_size; default: %(default)s)")
    medusa.set_defaults(run=run_medusa)
    distill = sub.add_parser("distill", help="DistillSpec: fine-tune the draft model toward the target "
                                             "(--method draft_model --draft DIR)",
                             description="Distil the draft model toward the target (DistillSpec): the draft writes "
                                         "answers to the data's prompts, the target scores every position, and "
                                         "LoRA adapters on the draft learn the target's distribution (forward KL). "
                                         "The adapters are merged and the result saved as a model folder; its "
                                         "acceptance is measured after the int4 quantization it drafts with.")
    _common(distill, output="the distilled draft's model folder (for --draft DIR)",
            answerer="the draft")
    distill.add_argument("--draft", default=None,
                         help="the draft to distil: a catalog name, HF folder or .gguf with the target's "
                              "vocabulary (default: the target's default draft)")
    distill.add_argument("--lora-rank", type=int, default=16, metavar="R",
                         help="rank of the adapters on every linear layer (default: %(default)s)")
    distill.add_argument("--responses", choices=("draft", "data"), default="draft",
                         help="who writes the answers trained on: the draft itself, for every prompt (on-policy, "
                              "DistillSpec's recommendation) or the data as given (file pieces, JSONL responses; default: "
                              "%(default)s)")
    distill.add_argument("--temperature", type=float, default=0.0, metavar="T",
                         help="the draft's sampling temperature when it writes answers (default: %(default)s, "
                              "greedy, as the draft proposes under greedy decoding)")
    distill.set_defaults(run=run_distill)


def _common(p: argparse.ArgumentParser, output: str = "the head folder", answerer: str = "the target") -> None:
    """Flags every trainer shares; ``output`` names what --out becomes, ``answerer`` who writes missing answers."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="target: a catalog name, a local HF folder or a .gguf file (default: %(default)s)")
    p.add_argument("--data", nargs="+", required=True, metavar="SOURCE",
                   help="folders of text or code (each file's pieces become answers to chat prompts), .jsonl "
                        "files of {\"prompt\" or \"messages\", optional \"response\"}, or text files of one "
                        f"prompt per line; prompts without a response are answered by {answerer}")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help=f"{output} to write; it also keeps the run's checkpoint and captured data")
    p.add_argument("--budget-minutes", type=float, default=None, metavar="N",
                   help="minutes of training (data capture not counted); training stops when they are used "
                        "(default: 60 unless --max-steps is given)")
    p.add_argument("--max-steps", type=int, default=None, metavar="N", help="stop after N optimizer steps")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint, with the budget that was left")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the drafter trains (the target always runs on the CPU; default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--piece-tokens", type=int, default=384, metavar="N",
                   help="tokens of a file per training sequence (default: %(default)s)")
    p.add_argument("--max-sequences", type=int, default=None, metavar="N",
                   help="use at most N sequences (default: all the sources hold)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                   help=f"most tokens in each answer {answerer} writes (default: %(default)s)")
    p.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                   help="share of sequences held out for validation (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=50, metavar="N", help="steps between validations")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order and the initial weights")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def _options(args: argparse.Namespace):
    from specdecode.train.data import DataConfig
    from specdecode.train.jobs import TrainOptions, command_line
    from specdecode.train.loop import LoopConfig

    for name in ("max_steps", "max_sequences", "piece_tokens", "max_new_tokens", "eval_every"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.budget_minutes is not None and args.budget_minutes <= 0:
        raise InvalidConfigError(f"--budget-minutes must be positive, got {args.budget_minutes}")
    if not 0.0 <= args.val_fraction < 0.5:
        raise InvalidConfigError(f"--val-fraction must be in [0, 0.5), got {args.val_fraction}")
    if args.lr <= 0:
        raise InvalidConfigError(f"--lr must be positive, got {args.lr}")
    budget = args.budget_minutes if args.budget_minutes is not None or args.max_steps is not None else 60.0
    return TrainOptions(
        model=args.model, sources=tuple(args.data), out=args.out, resume=args.resume, device=args.device,
        data=DataConfig(piece_tokens=args.piece_tokens, max_sequences=args.max_sequences,
                        val_fraction=args.val_fraction, seed=args.seed),
        loop=LoopConfig(lr=args.lr, budget_minutes=budget, max_steps=args.max_steps, eval_every=args.eval_every,
                        seed=args.seed),
        max_new_tokens=args.max_new_tokens, progress=not args.no_progress, command=command_line(sys.argv[1:]))


def run_eagle3(args: argparse.Namespace) -> int:
    from specdecode.train.jobs import train_eagle3

    if args.draft_vocab_size < 1 or args.ttt_steps < 1:
        raise InvalidConfigError("--draft-vocab-size and --ttt-steps must be at least 1")
    if args.intermediate_size is not None and args.intermediate_size < 1:
        raise InvalidConfigError(f"--intermediate-size must be at least 1, got {args.intermediate_size}")
    state = train_eagle3(_options(args), draft_vocab_size=args.draft_vocab_size,
                         intermediate_size=args.intermediate_size, ttt_steps=args.ttt_steps, layout=args.format)
    last = state.history[-1]
    print(f"wrote {args.out}: {state.step} steps, validation tau {last.get('tau')}, "
          f"acceptance by position {last.get('accept')}")
    return 0


def run_medusa(args: argparse.Namespace) -> int:
    from specdecode.train.jobs import train_medusa

    if min(args.num_heads, args.num_layers, args.vocab_size) < 1:
        raise InvalidConfigError("--num-heads, --num-layers and --vocab-size must be at least 1")
    state = train_medusa(_options(args), num_heads=args.num_heads, num_layers=args.num_layers,
                         vocab_size=args.vocab_size)
    last = state.history[-1]
    print(f"wrote {args.out}: {state.step} steps, validation tau {last.get('tau')}, "
          f"acceptance by position {last.get('accept')}")
    return 0


def run_distill(args: argparse.Namespace) -> int:
    from specdecode.train.jobs import train_distill

    if args.lora_rank < 1:
        raise InvalidConfigError(f"--lora-rank must be at least 1, got {args.lora_rank}")
    if not args.temperature >= 0:
        raise InvalidConfigError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    state = train_distill(_options(args), draft=args.draft, rank=args.lora_rank, temperature=args.temperature,
                         responses=args.responses)
    last = state.history[-1]
    print(f"wrote {args.out}: {state.step} steps, validation greedy agreement {last.get('agree')}, "
          f"sampled acceptance {last.get('accept')}")
    return 0
