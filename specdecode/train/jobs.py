"""``specdecode train eagle3|medusa|distill`` end to end: data, capture, training, the output folder and its card.

The output folder is the drafter (loadable by ``--eagle-head DIR``, ``--medusa-heads DIR`` or, distilled,
``--draft DIR``) and the run's workspace: the
captured examples (``.capture/``, reused by ``--resume`` when the data and target are unchanged),
the last checkpoint (``checkpoint/``) and the metrics (``train.json``). The head files are
rewritten at every checkpoint, so an interrupted run leaves a usable head.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdecode.config import DEFAULT_DRAFT_QUANTIZE, DEFAULT_DRAFTS
from specdecode.params import SamplingParams
from specdecode.errors import InvalidConfigError
from specdecode.api import LLM
from specdecode.heads.folders import write_files
from specdecode.models.config import ModelConfig, config_fingerprint
from specdecode.train.capture import (Example, TrainingSequence, capture, draft_vocabulary, load_examples,
                                      save_examples)
from specdecode.train.data import DataConfig, Respond, load_sequences
from specdecode.train.loop import LoopConfig, LoopState

log = logging.getLogger(__name__)

CAPTURE_DIR = ".capture"
SHARD = 64  # examples per capture file
DRAFT_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "chat_template.json")  # copied beside a distilled draft


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


def check_out(opts: TrainOptions) -> None:
    """Refuse an ``--out`` that is a file, or holds a run that ``--resume`` was not asked to continue."""
    if opts.out.exists() and not opts.out.is_dir():
        raise InvalidConfigError(f"--out {opts.out} is a file; give a folder")
    if not opts.resume and (opts.out / "checkpoint").exists():
        raise InvalidConfigError(f"{opts.out} holds a training run already: pass --resume to continue it, or "
                                 "choose another --out")


def prepare(opts: TrainOptions, layers_for: Callable[[ModelConfig], Sequence[int]], *, llm: LLM | None = None,
            respond: Respond | None = None, rewrite: bool = False, key_extra: dict | None = None
            ) -> tuple[LLM, list[Example], list[Example], dict]:
    """Load the target (unless ``llm`` is given), read the data and capture the states of
    ``layers_for(target config)`` (or reuse that capture). Prompts without a response are
    answered by ``respond`` (default: the target, greedy); with ``rewrite`` every sequence's
    response is replaced by ``respond``'s. Returns the LLM, the train and validation examples,
    and a description of the data for the card."""
    check_out(opts)
    if llm is None:
        llm = LLM(opts.model, max_seq_len=8192, progress=opts.progress)
    layers = tuple(layers_for(llm.target.config))
    if respond is None:
        greedy = SamplingParams(max_tokens=opts.max_new_tokens)

        def respond(prompt: list[int]) -> list[int]:
            return llm.generate(prompt, greedy, method="ngram")[0].token_ids

    key = _capture_key(opts, config_fingerprint(llm.model_dir), layers, key_extra or {})
    folder = opts.out / CAPTURE_DIR / key
    if (folder / "manifest.json").is_file():
        manifest = json.loads((folder / "manifest.json").read_text())
        examples = [ex for shard in manifest["shards"] for ex in load_examples(folder / shard)]
        split = manifest["train"]
        log.info(f"specdecode: reusing {len(examples)} captured sequences from {folder}")
        return llm, examples[:split], examples[split:], manifest["data"]
    # With ``rewrite`` every response is written below, once: prompts get a stand-in answer here.
    train_seqs, val_seqs = load_sequences(opts.sources, llm.tokenizer, opts.data,
                                          (lambda prompt: prompt[-1:]) if rewrite else respond)
    if rewrite:
        train_seqs, val_seqs = _answer(train_seqs + val_seqs, respond, len(train_seqs), opts.progress)
    seqs = train_seqs + val_seqs
    examples = _capture_all(llm.target, seqs, layers, folder, opts.progress)
    data = {"sources": list(opts.sources), "sequences": len(seqs), "validation_sequences": len(val_seqs),
            "tokens": sum(len(s.token_ids) for s in seqs),
            "trained_positions": int(sum(int(ex.loss_mask.sum()) for ex in examples[: len(train_seqs)])),
            **(key_extra or {})}
    shards = sorted(p.name for p in folder.glob("shard-*.safetensors"))
    (folder / "manifest.json").write_text(json.dumps({"shards": shards, "train": len(train_seqs), "data": data}))
    return llm, examples[: len(train_seqs)], examples[len(train_seqs) :], data


def _answer(seqs: list[TrainingSequence], respond: Respond, split: int, progress: bool
            ) -> tuple[list[TrainingSequence], list[TrainingSequence]]:
    """Each sequence's prompt with ``respond``'s answer instead of its response."""
    from tqdm import tqdm

    out = []
    for seq in tqdm(seqs, desc="writing responses", unit="seq", file=sys.stderr, disable=not progress):
        prompt = seq.token_ids[: seq.prompt_len]
        out.append(TrainingSequence(prompt + respond(prompt), len(prompt)))
    return out[:split], out[split:]


def _capture_key(opts: TrainOptions, fingerprint: str, layers: Sequence[int], extra: dict) -> str:
    blob = json.dumps({"target": fingerprint, "layers": list(layers), "sources": [str(Path(s).resolve())
                       for s in opts.sources], "data": asdict(opts.data), "new": opts.max_new_tokens, **extra})
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


def train_distill(opts: TrainOptions, *, draft: str | None, rank: int, temperature: float,
                  responses: str) -> LoopState:
    """DistillSpec: LoRA-fine-tune ``draft`` toward ``opts.model`` (``train/distill.py``) and
    write the merged draft into ``opts.out``, a model folder for ``--draft DIR``."""
    from specdecode.models import draft_quant
    from specdecode.models.catalog import resolve_model
    from specdecode.train import distill, loop
    from specdecode.train.student import Student

    device = check_device(opts.device)
    check_out(opts)
    draft = draft or DEFAULT_DRAFTS.get(opts.model)
    if draft is None:
        raise InvalidConfigError(f"no default draft for {opts.model!r}: pass --draft")
    llm = LLM(opts.model, draft=draft, max_seq_len=8192, progress=opts.progress,
              draft_vocab=0)  # distillation trains and scores the draft's whole head
    if llm.draft_tokenizer is not None:
        raise InvalidConfigError(f"--draft {draft} has another vocabulary than {opts.model}: DistillSpec needs a "
                                 "draft that speaks the target's tokens")
    draft_dir = resolve_model(draft, progress=opts.progress)
    respond = distill.draft_responses(llm.draft_model, llm.tokenizer, opts.max_new_tokens, temperature,
                                      opts.loop.seed)
    extra = {"draft": draft, "draft_fingerprint": config_fingerprint(draft_dir), "responses": responses,
             "temperature": temperature}
    llm, train, val, data = prepare(opts, lambda cfg: (), llm=llm, respond=respond, rewrite=responses == "draft",
                                    key_extra=extra)
    mode = draft_quant.usable_mode(DEFAULT_DRAFT_QUANTIZE, "float32")
    before = distill.quantized_acceptance(llm.draft_model, val)
    student = Student.from_dir(draft_dir, rank=rank, seed=opts.loop.seed).to(device)
    untrained = distill.evaluate(student, [_to(ex, device) for ex in val])  # before a checkpoint is resumed
    started = time.time()
    fingerprint = config_fingerprint(llm.model_dir)
    checked: dict = {}

    def save(state: LoopState) -> None:
        record = _record(opts, data, state, started, {"draft": draft, "lora_rank": rank, "lora_alpha": student.alpha,
                                                      "responses": responses, "temperature": temperature})
        record["untrained"] = untrained
        record["quantized"] = {"mode": mode, "untrained": before, **checked}
        config = {**json.loads((draft_dir / "config.json").read_text()), "torch_dtype": "bfloat16",
                  "specdecode": {"distilled_from": draft, "target": opts.model, "target_fingerprint": fingerprint}}
        weights = student.merged_weights()
        writers = {"model.safetensors": lambda path: save_file(weights, str(path), metadata={"format": "pt"}),
                   "config.json": lambda path: path.write_text(json.dumps(config, indent=2) + "\n")}
        for name in DRAFT_FILES:
            if (draft_dir / name).is_file():
                writers[name] = lambda path, name=name: shutil.copyfile(draft_dir / name, path)
        writers["README.md"] = lambda path: path.write_text(_draft_card(opts, record))
        writers["train.json"] = lambda path: path.write_text(json.dumps(record, indent=2) + "\n")
        write_files(opts.out, writers)

    state = loop.run(student, train, lambda ex: distill.loss(student, _to(ex, device)),
                     lambda: distill.evaluate(student, [_to(ex, device) for ex in val]),
                     opts.out, opts.loop, resume=opts.resume, on_checkpoint=save, progress=opts.progress)
    checked["trained"] = distill.quantized_acceptance(distill.merged_decoder(student.cpu(), mode), val)
    save(state)
    return state


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


def _draft_card(opts: TrainOptions, record: dict) -> str:
    val, shape, quantized = record["validation"], record["shape"], record["quantized"]

    def measured(m: dict | None) -> str:
        return "not measured yet" if not m else f"greedy agreement {m['agree']}, sampled acceptance {m['accept']}"

    return (f"# `{shape['draft']}` distilled toward `{opts.model}` (DistillSpec)\n\n"
            f"Trained by specdecode on {record['finished_utc']} UTC; use with `specdecode generate --model {opts.model} "
            f"--method draft_model --draft {opts.out}`.\n\n"
            f"- Target: `{opts.model}` (config fingerprint in `config.json`, `specdecode.target_fingerprint`)\n"
            f"- Data: {', '.join(f'`{s}`' for s in opts.sources)}: {record['data'].get('sequences')} sequences, "
            f"{record['data'].get('tokens')} tokens, {record['data'].get('validation_sequences')} held out; "
            f"responses written by {'the draft (on-policy)' if shape['responses'] == 'draft' else 'the data'}\n"
            f"- Training: LoRA rank {shape['lora_rank']} on every linear layer, merged; forward KL to the target; "
            f"{record['steps']} steps in {record['train_seconds']} s\n"
            f"- Validation, float weights: untrained {measured(record['untrained'])}; trained {measured(val)}\n"
            f"- Validation, {quantized['mode']} as drafted: untrained {measured(quantized['untrained'])}; "
            f"trained {measured(quantized.get('trained'))}\n"
            f"- Command: `{record['command']}`\n")


def command_line(argv: Sequence[str]) -> str:
    return "specdecode " + " ".join(shlex.quote(a) for a in argv)
