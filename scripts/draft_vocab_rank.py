"""Rank the vocabulary for a draft model's restricted LM head by the tokens the target writes.

The target answers calibration prompts greedily and every token of its answers is counted; the
ranking (``specdecode/drafters/draft_vocab.py``: special tokens, then the seen tokens by count,
then the rest by BPE id) is written with the tokenizer's fingerprint, by default over the file
the package ships. The calibration prompts are DISJOINT from what ``specdecode bench --limit 3``
runs (the first three prompts of each built-in workload): they are the built-in prompts from
index 3 on plus the prompts in ``EXTRA_PROMPTS`` below, so a benchmark of a restricted draft
never runs a prompt whose answer chose its vocabulary.

The answers are the target's plain greedy decoding; they are generated with a draft model
(``--method``), which greedy speculative decoding reproduces token for token, only faster.

``--answers`` keeps every answer as it comes (rows like a bench's results.jsonl), and
``--from-answers`` makes the ranking from such a file without running the target again.

``--prompts bench`` instead answers the bench's first ``--limit`` prompts per workload and writes
only ``--answers`` (rows like a bench's results.jsonl), the held-out text on which
``scripts/draft_agreement.py --vocab`` measures a restricted draft's agreement.

    python scripts/draft_vocab_rank.py                      # regenerate the shipped ranking
    python scripts/draft_vocab_rank.py --prompts bench --limit 3 --max-tokens 192 --answers held_out.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from specdecode import LLM, SamplingParams
from specdecode.bench.workloads import (WORKLOAD_NAMES, Prompt, limit_per_category, load_workloads,
                                        parse_workload_names)
from specdecode.drafters.draft_vocab import RANKING_PATH, VocabRanking, rank_tokens, save_ranking, special_ids
from specdecode.index.fingerprint import tokenizer_fingerprint
from specdecode.models.catalog import resolve_model
from specdecode.models.config import ModelConfig
from specdecode.tokenizer import Tokenizer

BENCH_LIMIT = 3  # ``specdecode bench --limit 3`` runs each workload's prompts 0..2: never calibrate on them

EXTRA_PROMPTS: dict[str, tuple[str, ...]] = {
    "code": (
        "Write a Python function that merges overlapping intervals given as a list of (start, end) tuples.",
        "Implement a thread-safe LRU cache class in Python with get and put methods and type hints.",
        "Write a JavaScript function that debounces another function, with a short usage example.",
        "Write a Rust function that parses a comma-separated line of integers into a Vec<i64>, "
        "returning an error for bad input.",
        "Write a SQL query that returns, for each customer, their three most recent orders, from tables "
        "customers(id, name) and orders(id, customer_id, created_at, total).",
        "Write a bash script that finds the ten largest files under a directory and prints their sizes.",
        "Write pytest tests for a function slugify(text: str) -> str that lowercases text and replaces "
        "runs of non-alphanumeric characters with single hyphens.",
        "Explain the difference between a process and a thread, then show a Python example of each.",
        "Write a C function that reverses a singly linked list in place.",
        "Write a Go HTTP handler that returns the current server time as JSON.",
    ),
    "chat": (
        "What are some good habits for keeping a small vegetable garden healthy through the summer?",
        "Give me a three-day itinerary for a first visit to Lisbon.",
        "How do I politely decline a meeting invitation from my manager?",
        "Explain how vaccines train the immune system, in simple terms.",
        "Suggest five names for a coffee shop that also sells used books, with a line about each.",
    ),
    "math": (
        "A train travels 240 km in 3 hours and then 180 km in 2 hours. What is its average speed? "
        "Show your reasoning.",
        "Solve for x: 3(x - 4) + 2 = 5x - 10. Explain each step.",
        "What is the probability of rolling two dice and getting a sum of 8? Explain.",
        "Find the derivative of f(x) = x^3 * ln(x) and explain the rule you use.",
    ),
    "translation": (
        "Translate into French: 'The meeting has been moved to Thursday afternoon because the room was "
        "not available.'",
        "Translate into German: 'Please make sure all windows are closed before you leave the office.'",
        "Translate into Spanish: 'We are looking for volunteers to help organise the community festival "
        "next month.'",
    ),
    "summarization": (
        "Summarize in three sentences: Remote work has changed how companies hire. Firms that once "
        "recruited within commuting distance now interview candidates across time zones, which widens "
        "the talent pool but complicates collaboration. Many teams have adopted written, asynchronous "
        "communication, recording decisions in shared documents rather than meetings. Critics argue "
        "that new employees learn more slowly without informal contact, and some companies have asked "
        "staff to return to offices several days a week. Surveys suggest most workers prefer a hybrid "
        "arrangement.",
    ),
}


def calibration_prompts() -> list[Prompt]:
    """The built-in prompts from index ``BENCH_LIMIT`` on and ``EXTRA_PROMPTS``, taken round-robin
    over the sources so that a run stopped early (``--from-answers`` ranks what it wrote) still
    covers every kind of text."""
    builtin = [p for p in load_workloads(list(WORKLOAD_NAMES)) if int(p.id.rsplit("/", 1)[1]) >= BENCH_LIMIT]
    extra = [Prompt(f"calibration-{cat}/{i}", cat, (text,)) for cat, texts in EXTRA_PROMPTS.items()
             for i, text in enumerate(texts)]
    groups: dict[str, list[Prompt]] = {}
    for prompt in builtin + extra:
        groups.setdefault(prompt.id.split("/")[0], []).append(prompt)
    rounds = max(len(g) for g in groups.values())
    return [g[i] for i in range(rounds) for g in groups.values() if i < len(g)]


def answer(llm: LLM, prompts: list[Prompt], max_tokens: int, out: Path | None) -> list[dict]:
    """The target's greedy answers as results.jsonl rows, each appended to ``out`` as it comes."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rows = []
    if out is not None:
        out.write_text("")
    for prompt in tqdm(prompts, desc="target answers", unit="prompt", file=sys.stderr):
        result = llm.chat([{"role": "user", "content": prompt.turns[0]}], params)
        row = {"prompt_id": prompt.id, "category": prompt.category, "method": "none", "turn": 0,
               "token_ids": list(result.token_ids)}
        rows.append(row)
        if out is not None:
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="only speeds the target's greedy answers")
    p.add_argument("--method", default="draft_model", help="how the answers are generated (greedy: always exact)")
    p.add_argument("--prompts", choices=("calibration", "bench"), default="calibration")
    p.add_argument("--limit", type=int, default=BENCH_LIMIT, help="--prompts bench: prompts per workload")
    p.add_argument("--workload", default="all", help="--prompts bench: comma-separated workloads (default: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--out", type=Path, default=RANKING_PATH, help="the ranking file (--prompts calibration)")
    p.add_argument("--answers", type=Path, default=None, help="also write the answers as results.jsonl rows")
    p.add_argument("--from-answers", type=Path, default=None,
                   help="rank from the calibration answers in this file (written by --answers) instead of "
                        "running the target")
    args = p.parse_args()
    if args.from_answers is not None:
        rows = [json.loads(line) for line in args.from_answers.read_text().splitlines() if line.strip()]
        calibration = {pr.id for pr in calibration_prompts()}
        if not rows or any(r["prompt_id"] not in calibration for r in rows):
            sys.exit(f"{args.from_answers}: every row must answer a calibration prompt (none of the bench's)")
        tokenizer = Tokenizer.from_dir(resolve_model(args.model))
        vocab_size = ModelConfig.from_dir(resolve_model(args.model)).vocab_size
    else:
        prompts = (calibration_prompts() if args.prompts == "calibration"
                   else limit_per_category(load_workloads(parse_workload_names(args.workload)), args.limit))
        llm = LLM(args.model, draft=args.draft, method=args.method, draft_vocab=0, max_seq_len=4096)
        rows = answer(llm, prompts, args.max_tokens, args.answers)
        tokenizer, vocab_size = llm.tokenizer, llm.target.config.vocab_size
    if args.prompts != "calibration":
        return
    counts = Counter(t for r in rows for t in r["token_ids"])
    source = (f"scripts/draft_vocab_rank.py: greedy answers of {args.model} (max {args.max_tokens} tokens) to "
              f"{len(rows)} calibration prompts, {sum(counts.values())} tokens, {len(counts)} distinct")
    ranking = VocabRanking(vocab_size, tokenizer_fingerprint(tokenizer),
                           rank_tokens(counts, special_ids(tokenizer), vocab_size), source)
    save_ranking(ranking, args.out)
    print(f"{source}; wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
