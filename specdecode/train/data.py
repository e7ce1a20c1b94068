"""Training sequences for drafters: chat prompts with responses, from the user's own files.

Sources (``--data``, any number):
- a **folder**: every text file under it (source code, docs; binary and huge files skipped) in
  pieces of about ``piece_tokens`` tokens, each the answer to a chat prompt that asks for that
  piece of that file ("teacher-forced existing text"). For the default code model, a repository
  or the Python standard library (``python -c "import os; print(os.__file__)"`` names its folder)
  is what its users ask about;
- a **.jsonl** file: one object per line with a ``"prompt"`` string or ``"messages"`` list, and
  optionally a ``"response"``; prompts without one are answered by the target itself (greedy,
  through the speculative engine, exact) when ``generate`` is given, else skipped;
- a **text file**: one prompt per line, answered like JSONL prompts.

Sequences are shuffled with a seed, then a ``val_fraction`` slice is held out for validation.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import InvalidConfigError
from specdecode.files import read_user_text
from specdecode.tokenizer import Tokenizer
from specdecode.train.capture import TrainingSequence

TEXT_SUFFIXES = frozenset(".py .pyi .md .rst .txt .c .h .cc .cpp .hpp .rs .go .java .js .ts .tsx .jsx .sh .toml "
                          ".yaml .yml .json .html .css .sql .rb .kt .swift .scala .lua .r .jl .cfg .ini".split())
MAX_FILE_BYTES = 512 * 1024
MAX_PROMPTS_FILE_BYTES = 256 << 20  # a named prompts file (JSONL or lines); stops /dev/zero
SKIP_DIRS = frozenset({".git", "__pycache__", "node_modules", ".venv", "venv", "build", "dist", ".tox"})

# Generates a response for a prompt's token ids (the target answering it).
Respond = Callable[[list[int]], list[int]]


@dataclass(frozen=True, slots=True)
class DataConfig:
    piece_tokens: int = 384  # response tokens per piece of a file
    max_sequences: int | None = None
    val_fraction: float = 0.05
    seed: int = 0


def load_sequences(sources: Sequence[str | Path], tokenizer: Tokenizer, cfg: DataConfig,
                   respond: Respond | None = None) -> tuple[list[TrainingSequence], list[TrainingSequence]]:
    """(train, validation) sequences from ``sources``; raises ``InvalidConfigError`` when a
    source is missing or nothing usable was found."""
    found: list[TrainingSequence] = []
    rng = random.Random(cfg.seed)
    for source in sources:
        path = Path(source).expanduser()
        if path.is_dir():
            files = sorted(_text_files(path))
            rng.shuffle(files)  # a budget of sequences then samples the whole folder
            for file in files:
                found.extend(_file_pieces(file, path, tokenizer, cfg.piece_tokens))
                if cfg.max_sequences and len(found) >= 2 * cfg.max_sequences:
                    break
        elif path.is_file():
            found.extend(_prompt_sequences(path, tokenizer, respond, cfg.max_sequences))
        else:
            kind = "not a regular file or folder" if path.exists() else "no such file or folder"
            raise InvalidConfigError(f"--data {source}: {kind}")
    if not found:
        raise InvalidConfigError("the --data sources hold no usable text: give folders of text or code, or JSONL "
                                 "prompts (with responses, or let the target answer them)")
    rng.shuffle(found)
    if cfg.max_sequences:
        found = found[: cfg.max_sequences]
    held = max(1, round(len(found) * cfg.val_fraction)) if cfg.val_fraction > 0 and len(found) > 1 else 0
    return found[held:], found[:held]


def _text_files(root: Path) -> Iterator[Path]:
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        for name in files:
            path = Path(folder) / name
            if path.suffix.lower() in TEXT_SUFFIXES:
                try:
                    if 0 < path.stat().st_size <= MAX_FILE_BYTES:
                        yield path
                except OSError:
                    continue


def _file_pieces(path: Path, root: Path, tokenizer: Tokenizer, piece_tokens: int) -> list[TrainingSequence]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    if "\x00" in text or not text.strip():
        return []
    ids = tokenizer.encode(text)
    name = path.relative_to(root).as_posix()
    pieces = []
    for part, start in enumerate(range(0, len(ids), piece_tokens)):
        piece = ids[start : start + piece_tokens]
        if len(piece) < 16:
            continue
        ask = f"Write part {part + 1} of the file `{name}`." if len(ids) > piece_tokens else f"Write the file `{name}`."
        prompt = _chat(tokenizer, [{"role": "user", "content": ask}])
        pieces.append(TrainingSequence(prompt + piece, len(prompt)))
    return pieces


def _prompt_sequences(path: Path, tokenizer: Tokenizer, respond: Respond | None,
                      limit: int | None) -> list[TrainingSequence]:
    text = read_user_text(path, "--data", MAX_PROMPTS_FILE_BYTES)
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    out = []
    for number, line in lines:
        if limit and len(out) >= limit:
            break
        messages, response = _parse(path, number, line) if path.suffix == ".jsonl" else ([{"role": "user",
                                                                                          "content": line}], None)
        prompt = _chat(tokenizer, messages)
        if response is not None:
            answer = tokenizer.encode(response)
        elif respond is not None:
            answer = respond(prompt)
        else:
            continue
        if answer:
            out.append(TrainingSequence(prompt + answer, len(prompt)))
    return out


def _parse(path: Path, number: int, line: str) -> tuple[list[dict[str, str]], str | None]:
    try:
        obj = json.loads(line)
    except ValueError:
        raise InvalidConfigError(f"{path} line {number}: not a JSON object") from None
    if not isinstance(obj, dict):
        raise InvalidConfigError(f"{path} line {number}: expected a JSON object")
    if isinstance(obj.get("messages"), list) and obj["messages"]:
        messages = obj["messages"]
        if messages[-1].get("role") == "assistant" and "response" not in obj:
            return messages[:-1], str(messages[-1].get("content", ""))
        return messages, obj.get("response")
    if isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
        return [{"role": "user", "content": obj["prompt"]}], obj.get("response")
    raise InvalidConfigError(f"{path} line {number}: expected a \"prompt\" string or a \"messages\" list")


def _chat(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    if tokenizer.chat_template:
        return tokenizer.encode_chat(messages)
    return tokenizer.encode("\n".join(m["content"] for m in messages) + "\n")
