"""Built-in workloads: named sets of prompts, and the ``Prompt`` record every loader produces.

Acceptance depends on the workload (code edits repeat their input, chat does not), so the
benchmark reports per category. Built-in prompts are Python data shipped with the package; a
user's own prompts come in Spec-Bench's format (see ``specbench.py``). Both become ``Prompt``s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specdecode.errors import InvalidConfigError


@dataclass(frozen=True, slots=True)
class Prompt:
    """One conversation to benchmark: user turns sent one after another (each after the model's
    own previous answer), grouped in reports by ``category``."""

    id: str  # "code/0" for built-ins; Spec-Bench's question_id as text
    category: str
    turns: tuple[str, ...]


def _registry() -> dict[str, tuple[str | tuple[str, ...], ...]]:
    """Name -> prompts (a text, or a conversation's user turns); imported lazily so the CLI's
    start-up does not load prompt text."""
    from specdecode.bench.prompts_agent import AGENT, AGENT_TOOLS
    from specdecode.bench.prompts_code import CODE, CODE_EDIT, FILE_EDIT
    from specdecode.bench.prompts_other import MATH, TRANSLATION
    from specdecode.bench.prompts_text import CHAT, RAG, SUMMARIZATION

    return {"code": CODE, "code-edit": CODE_EDIT, "chat": CHAT, "summarization": SUMMARIZATION,
            "rag": RAG, "math": MATH, "translation": TRANSLATION, "agent": AGENT, "agent-tools": AGENT_TOOLS,
            "file-edit": FILE_EDIT}


# Single-turn workloads; ``all`` names these.
WORKLOAD_NAMES: tuple[str, ...] = ("code", "code-edit", "chat", "summarization", "rag", "math", "translation")
# Conversations that grow turn by turn (a prefix cache's case), chosen by name only: their later
# turns stand on thousands of tokens, which ``all`` should not add to a run unasked.
MULTI_TURN_WORKLOADS: tuple[str, ...] = ("agent", "agent-tools")
# Whole-file edits answered with the whole file (predicted outputs' case, ``--prediction``): long
# answers, chosen by name only.
NAMED_ONLY_WORKLOADS: tuple[str, ...] = (*MULTI_TURN_WORKLOADS, "file-edit")


def parse_workload_names(text: str) -> list[str]:
    """``"code,chat"`` -> ``["code", "chat"]``; ``all`` expands; unknown names are a user error."""
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        expanded = list(WORKLOAD_NAMES) if name == "all" else [name]
        for item in expanded:
            if item not in WORKLOAD_NAMES + NAMED_ONLY_WORKLOADS:
                raise InvalidConfigError(
                    f"unknown workload {item!r}; choose from "
                    f"{', '.join(WORKLOAD_NAMES + NAMED_ONLY_WORKLOADS)} or all"
                )
            if item not in names:
                names.append(item)
    if not names:
        raise InvalidConfigError("--workload is empty; name at least one workload or all")
    return names


def load_workloads(names: Sequence[str]) -> list[Prompt]:
    """Every prompt of the named workloads, in registry order within each workload."""
    registry = _registry()
    prompts = []
    for name in names:
        if name not in registry:
            raise InvalidConfigError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)} or all")
        prompts.extend(Prompt(f"{name}/{i}", name, text if isinstance(text, tuple) else (text,))
                       for i, text in enumerate(registry[name]))
    return prompts


def limit_per_category(prompts: Iterable[Prompt], limit: int | None) -> list[Prompt]:
    """Keep the first ``limit`` prompts of each category, so ``--limit 2 --workload all`` still
    covers every category (a global cut would drop the last workloads entirely)."""
    if limit is None:
        return list(prompts)
    if limit < 1:
        raise InvalidConfigError(f"--limit must be >= 1, got {limit}")
    seen: dict[str, int] = {}
    kept = []
    for prompt in prompts:
        if seen.get(prompt.category, 0) < limit:
            seen[prompt.category] = seen.get(prompt.category, 0) + 1
            kept.append(prompt)
    return kept


# A fence opens and closes at the start of a line: "in one ```python block" inside a sentence is text.
_FENCED = re.compile(r"^```[^\n`]*\n.*?^```", re.DOTALL | re.MULTILINE)


def last_code_block(text: str) -> str | None:
    """The prediction a coding tool sends with an edit request (``bench --prediction``): the
    prompt's last fenced code block, fences included, as the answer is expected to repeat it;
    None when the prompt has none."""
    blocks = _FENCED.findall(text)
    return blocks[-1] if blocks else None
