"""``specdecode train eagle3|medusa`` end to end: data, capture, training, the head folder and its card.

The output folder is the head (loadable by ``--eagle-head DIR`` or ``--medusa-heads DIR``) and the run's workspace: the
captured examples (``.capture/``, reused by ``--resume`` when the data and target are unchanged),
the last checkpoint (``checkpoint/``) and the metrics (``train.json``). The head files are
rewritten at every checkpoint, so an interrupted run leaves a usable head.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from specdecode.config import SamplingParams
from specdecode.errors import InvalidConfigError
from specdecode.api import LLM
from specdecode.models.config import ModelConfig, config_fingerprint
from specdecode.train.capture import (Example, TrainingSequence, capture, draft_vocabulary, load_examples,
                                      save_examples)
from specdecode.train.data import DataConfig, load_sequences
from specdecode.train.loop import LoopConfig, LoopState

CAPTURE_DIR = ".capture"
SHARD = 64  # examples per capture file


@dataclass(frozen=True)
class TrainOptions:
    model: str
    sources: tuple[str, ...]
    out: Path
    data: DataConfig = field(default_factory=DataConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    resume: bool = False
    device: str = "cpu"
    max_new_tokens: int = 256  # for prompts the target answers
    progress: bool = True
    command: str = ""  # the command line, for the model card


def check_device(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidConfigError("--device cuda: this torch build sees no CUDA device; use --device cpu")
    if device not in ("cpu", "cuda"):
        raise InvalidConfigError(f"--device must be cpu or cuda, got {device!r}")
    return torch.device(device)


def prepare(opts: TrainOptions, layers_for: Callable[[ModelConfig], Sequence[int]]
            ) -> tuple[LLM, list[Example], list[Example], dict]:
    """Load the target, read the data and capture the states of ``layers_for(target config)``
    (or reuse that capture). Returns the LLM, the train and validation examples, and a
    description of the data for the card."""
    if opts.out.exists() and not opts.out.is_dir():
        raise InvalidConfigError(f"--out {opts.out} is a file; give a folder")
    if not opts.resume and (opts.out / "checkpoint").exists():
        raise InvalidConfigError(f"{opts.out} holds a training run already: pass --resume to continue it, or "
                                 "choose another --out")
    llm = LLM(opts.model, max_seq_len=8192, progress=opts.progress)
    layers = tuple(layers_for(llm.target.config))
    greedy = SamplingParams(max_tokens=opts.max_new_tokens)

    def respond(prompt: list[int]) -> list[int]:
        return llm.generate(prompt, greedy, method="ngram")[0].token_ids

    key = _capture_key(opts, config_fingerprint(llm.model_dir), layers)
    folder = opts.out / CAPTURE_DIR / key
    if (folder / "manifest.json").is_file():
        manifest = json.loads((folder / "manifest.json").read_text())
        examples = [ex for shard in manifest["shards"] for ex in load_examples(folder / shard)]
        split = manifest["train"]
        print(f"specdecode: reusing {len(examples)} captured sequences from {folder}", file=sys.stderr)
        return llm, examples[:split], examples[split:], manifest["data"]
    train_seqs, val_seqs = load_sequences(opts.sources, llm.tokenizer, opts.data, respond)
    seqs = train_seqs + val_seqs
    examples = _capture_all(llm.target, seqs, layers, folder, opts.progress)
    data = {"sources": list(opts.sources), "sequences": len(seqs), "validation_sequences": len(val_seqs),
            "tokens": sum(len(s.token_ids) for s in seqs),
            "trained_positions": int(sum(int(ex.loss_mask.sum()) for ex in examples[: len(train_seqs)]))}
    shards = sorted(p.name for p in folder.glob("shard-*.safetensors"))
    (folder / "manifest.json").write_text(json.dumps({"shards": shards, "train": len(train_seqs), "data": data}))
    return llm, examples[: len(train_seqs)], examples[len(train_seqs) :], data


def _capture_key(opts: TrainOptions, fingerprint: str, layers: Sequence[int]) -> str:
    blob = json.dumps({"target": fingerprint, "layers": list(layers), "sources": [str(Path(s).resolve())
                       for s in opts.sources], "data": asdict(opts.data), "new": opts.max_new_tokens})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _capture_all(target, seqs: list[TrainingSequence], layers: Sequence[int], folder: Path,
                 progress: bool) -> list[Example]:
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    examples: list[Example] = []
    total = sum(len(s.token_ids) for s in seqs)
    with tqdm(total=total, desc="capturing target states", unit="tok", file=sys.stderr, disable=not progress) as bar:
        for i in range(0, len(seqs), SHARD):
            shard = []
            for seq in seqs[i : i + SHARD]:
                shard.append(capture(target, seq, layers))
                bar.update(len(seq.token_ids))
            save_examples(shard, folder / f"shard-{i // SHARD:05d}.safetensors")
            examples.extend(shard)
    return examples


def train_eagle3(opts: TrainOptions, *, draft_vocab_size: int, intermediate_size: int | None, ttt_steps: int,
                 layout: str) -> LoopState:
    """Train an EAGLE-3 head for ``opts.model`` into ``opts.out``."""
    from specdecode.heads.eagle3 import Eagle3Config, default_hidden_layers
    from specdecode.heads.eagle3_format import save_eagle3
    from specdecode.train import eagle3, loop

    device = check_device(opts.device)
    llm, train, val, data = prepare(opts, lambda cfg: default_hidden_layers(cfg.num_layers))
    target = llm.target
    cfg = Eagle3Config.for_target(target.config, draft_vocab_size, intermediate_size)
    vocabulary = draft_vocabulary(train, cfg.draft_vocab_size, cfg.vocab_size)
    head = eagle3.new_head(target, cfg, vocabulary, opts.loop.seed).to(device)

    def embed(tokens: torch.Tensor) -> torch.Tensor:
        return target.embed_tokens(tokens).float().to(device)

    started = time.time()
    fingerprint = config_fingerprint(llm.model_dir)

    def save(state: LoopState) -> None:
        record = _record(opts, data, state, started, {"draft_vocab_size": cfg.draft_vocab_size,
                                                      "intermediate_size": cfg.intermediate_size,
                                                      "ttt_steps": ttt_steps})
        save_eagle3(head.cpu() if device.type != "cpu" else head, opts.out, layout, target_name=llm.model_name,
                    target_architecture=target.config.architecture, target_fingerprint=fingerprint,
                    extra={"training": record}, readme=_card("EAGLE-3 head", "--eagle-head", opts, record))
        head.to(device)
        (opts.out / "train.json").write_text(json.dumps(record, indent=2) + "\n")

    state = loop.run(head, train, lambda ex: eagle3.loss(head, _to(ex, device), embed, ttt_steps),
                     lambda: eagle3.evaluate(head, [_to(ex, device) for ex in val], embed, ttt_steps),
                     opts.out, opts.loop, resume=opts.resume, on_checkpoint=save, progress=opts.progress)
    return state


def train_medusa(opts: TrainOptions, *, num_heads: int, num_layers: int, vocab_size: int) -> LoopState:
    """Train Medusa heads for ``opts.model`` into ``opts.out``."""
    from specdecode.heads.medusa import MedusaConfig
    from specdecode.heads.medusa_format import save_medusa
    from specdecode.train import loop, medusa

    device = check_device(opts.device)
    llm, train, val, data = prepare(opts, lambda cfg: (cfg.num_layers,))
    target = llm.target
    truncated = min(vocab_size, target.config.vocab_size)
    cfg = MedusaConfig(target.config.hidden_size, target.config.vocab_size, num_heads, num_layers,
                       None if truncated == target.config.vocab_size else truncated)
    heads = medusa.new_heads(target, cfg, draft_vocabulary(train, cfg.draft_vocab_size, cfg.vocab_size),
                             opts.loop.seed).to(device)
    norm = medusa.TargetNorm(target)
    started = time.time()
    fingerprint = config_fingerprint(llm.model_dir)

    def save(state: LoopState) -> None:
        record = _record(opts, data, state, started, {"num_heads": num_heads, "num_layers": num_layers,
                                                      "truncated_vocab_size": cfg.draft_vocab_size})
        save_medusa(heads.cpu() if device.type != "cpu" else heads, opts.out, target_name=llm.model_name,
                    target_fingerprint=fingerprint, extra={"training": record},
                    readme=_card("Medusa heads", "--medusa-heads", opts, record))
        heads.to(device)
        (opts.out / "train.json").write_text(json.dumps(record, indent=2) + "\n")

    return loop.run(heads, train, lambda ex: medusa.loss(heads, _to(ex, device), norm),
                    lambda: medusa.evaluate(heads, [_to(ex, device) for ex in val], norm),
                    opts.out, opts.loop, resume=opts.resume, on_checkpoint=save, progress=opts.progress)


def _to(ex: Example, device: torch.device) -> Example:
    if device.type == "cpu":
        return ex
    return Example(*(getattr(ex, name).to(device) for name in Example.__slots__))


def _record(opts: TrainOptions, data: dict, state: LoopState, started: float, shape: dict) -> dict:
    last = state.history[-1] if state.history else {}
    return {"command": opts.command, "target": opts.model, "data": data, "shape": shape,
            "loop": asdict(opts.loop), "steps": state.step, "train_seconds": round(state.elapsed_s, 1),
            "finished_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "validation": last, "history": state.history, "session_seconds": round(time.time() - started, 1)}


def _card(kind: str, flag: str, opts: TrainOptions, record: dict) -> str:
    val = record["validation"]
    accept = ", ".join(f"{a:.3f}" for a in val.get("accept", []))
    return (f"# {kind} for `{opts.model}`\n\n"
            f"Trained by specdecode on {record['finished_utc']} UTC; load with `specdecode generate --method "
            f"{'eagle' if flag == '--eagle-head' else 'medusa'} {flag} {opts.out}`.\n\n"
            f"- Target: `{opts.model}` (config fingerprint in `config.json`, `specdecode.target_fingerprint`)\n"
            f"- Data: {', '.join(f'`{s}`' for s in opts.sources)}: {record['data'].get('sequences')} sequences, "
            f"{record['data'].get('tokens')} tokens, {record['data'].get('validation_sequences')} held out\n"
            f"- Steps: {record['steps']} in {record['train_seconds']} s of training\n"
            f"- Validation (teacher-forced, held-out sequences): tau {val.get('tau')}, acceptance by draft "
            f"position {accept}\n"
            f"- Command: `{record['command']}`\n")


def command_line(argv: Sequence[str]) -> str:
    return "specdecode " + " ".join(shlex.quote(a) for a in argv)
