"""Load prompts in Spec-Bench's ``question.jsonl`` format.

Spec-Bench (Xia et al. 2024) and MT-Bench store one question a line:
``{"question_id": 81, "category": "writing", "turns": ["first user turn", "second user turn"]}``.
Reading that format lets users benchmark on the published question set or on their own prompts
without writing code. A second turn is sent after the model's own first answer (the runner does
that through the chat template), exactly as Spec-Bench does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdecode.bench.workloads import Prompt
from specdecode.errors import InvalidConfigError
from specdecode.files import read_user_text

DEFAULT_CATEGORY = "uncategorized"
MAX_DATASET_BYTES = 256 << 20  # Spec-Bench's question.jsonl is 0.5 MB; stops /dev/zero


def load_specbench(path: Path | str) -> list[Prompt]:
    """Every question of ``path`` as a ``Prompt``; a malformed line is a user error naming it."""
    path = Path(path)
    text = read_user_text(path, "--dataset", MAX_DATASET_BYTES)
    prompts = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidConfigError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        prompt = _to_prompt(record, f"{path}:{number}")
        if prompt.id in seen:
            raise InvalidConfigError(f"{path}:{number}: duplicate question_id {prompt.id!r}")
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise InvalidConfigError(f"--dataset {path} holds no questions; expected one JSON object a line")
    return prompts


def _to_prompt(record: Any, where: str) -> Prompt:
    if not isinstance(record, dict):
        raise InvalidConfigError(f"{where}: expected a JSON object with question_id, category, turns")
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise InvalidConfigError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    if "question_id" not in record:
        raise InvalidConfigError(f"{where}: missing 'question_id'")
    category = record.get("category") or DEFAULT_CATEGORY
    if not isinstance(category, str):
        raise InvalidConfigError(f"{where}: 'category' must be a string")
    return Prompt(str(record["question_id"]), category, tuple(turns))
