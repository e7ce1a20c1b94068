"""Replay prompt lookup over recorded plain-decoding outputs: how many steps get a draft at all.

Greedy speculative decoding emits exactly the plain output, so a drafter's steps can be replayed
offline from a bench run's ``none`` rows without a model: each step drafts from the context, keeps
the prefix that matches the recorded output, and emits one more token. ``--skip-one`` adds a
substitution-tolerant fallback for steps whose last token is new: copy what followed the token
after the previous token's earlier occurrence. It shows how many n-gram steps run as plain
steps because there is nothing to copy, which is why ``limit_tokens_per_s`` counts every target
forward (docs/PERFORMANCE.md, "Design choices and their measurements").

    python scripts/ngram_coverage.py bench-results/final-k8/results.jsonl
"""

from __future__ import annotations

import argparse
import json

from specdecode.bench.workloads import WORKLOAD_NAMES, load_workloads
from specdecode.drafters.ngram import NgramDrafter
from specdecode.models.catalog import resolve_model
from specdecode.tokenizer import Tokenizer


def replay(prompt_ids: list[int], output: list[int], k: int, skip_one: bool) -> tuple[int, int, int]:
    """(steps, steps with a draft, accepted drafts) for one recorded output."""
    drafter = NgramDrafter(1, 4)
    steps = drafting = accepted = pos = 0
    while pos < len(output):
        context = prompt_ids + output[:pos]
        found = drafter.continuations(context, k, limit=1)
        draft = found[0] if found else []
        if not draft and skip_one:
            before = drafter.continuations(context[:-1], k + 1, limit=1)
            draft = before[0][1:] if before else []
        n = 0
        while n < len(draft) and pos + n < len(output) and draft[n] == output[pos + n]:
            n += 1
        steps, drafting, accepted = steps + 1, drafting + bool(draft), accepted + n
        pos += n + 1
    return steps, drafting, accepted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a bench results.jsonl with rows of method none")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="whose tokenizer and chat template")
    p.add_argument("-k", type=int, default=8)
    args = p.parse_args()
    tokenizer = Tokenizer.from_dir(resolve_model(args.model))
    prompts = {q.id: q for q in load_workloads(WORKLOAD_NAMES)}
    rows = [json.loads(line) for line in open(args.results, encoding="utf-8")]
    outputs = {r["prompt_id"]: r["token_ids"] for r in rows if r["method"] == "none" and r["turn"] == 0}
    for skip_one in (False, True):
        total = [0, 0, 0]
        for prompt_id, output in outputs.items():
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompts[prompt_id].turns[0]}])
            for i, v in enumerate(replay(tokenizer.encode(text), output, args.k, skip_one)):
                total[i] += v
        steps, drafting, accepted = total
        tau = 1 + accepted / max(drafting, 1)
        print(f"{'skip-one fallback' if skip_one else 'prompt lookup'}: {steps} steps, {drafting} with a draft "
              f"({drafting / steps:.0%}), tau {tau:.2f}, tokens per step {sum(map(len, outputs.values())) / steps:.2f}")


if __name__ == "__main__":
    main()
