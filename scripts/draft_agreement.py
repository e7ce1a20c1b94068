"""How often a quantized draft's top choice matches the target's greedy token, teacher-forced
over answers the target already gave (the ``none`` rows of a bench's results.jsonl).

This agreement is the draft's per-token acceptance under greedy verification, measured in a
minute without timing noise, so quantization schemes can be compared before a bench run. Every
position of each first-turn answer counts, with the chat-rendered prompt as context.

    python scripts/draft_agreement.py bench-results/s11-all/results.jsonl --quantize int8,int4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdecode.bench.workloads import WORKLOAD_NAMES, load_workloads
from specdecode.models import draft_quant
from specdecode.models.catalog import resolve_model
from specdecode.models.decoder import Decoder
from specdecode.tokenizer import Tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="a bench's results.jsonl with rows of method none")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--quantize", default="int8,int4", help="comma-separated: none, int8, int4")
    args = p.parse_args()
    rows = [json.loads(line) for line in args.results.read_text().splitlines()]
    answers = {r["prompt_id"]: r["token_ids"] for r in rows if r["method"] == "none" and r["turn"] == 0}
    prompts = {pr.id: pr for pr in load_workloads(list(WORKLOAD_NAMES)) if pr.id in answers}
    path = resolve_model(args.draft)
    tokenizer = Tokenizer.from_dir(path)
    draft_quant.INT4_MAX_ROWS = 1 << 30  # teacher forcing feeds whole answers: keep them on the int4 kernel
    for mode in args.quantize.split(","):
        model = Decoder.from_dir(path, role="draft", quantize=None if mode == "none" else mode)
        hits = total = 0
        per_category: dict[str, list[int]] = {}
        for pid, answer in answers.items():
            context = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompts[pid].turns[0]}]))
            cache = model.new_cache(len(context) + len(answer) + 8)
            model.forward(torch.tensor(context[:-1]), cache, last_only=True)
            logits = model.forward(torch.tensor(context[-1:] + answer[:-1]), cache)
            agree = int((logits.argmax(-1) == torch.tensor(answer)).sum())
            slot = per_category.setdefault(prompts[pid].category, [0, 0])
            slot[0] += agree
            slot[1] += len(answer)
            hits, total = hits + agree, total + len(answer)
        cats = ", ".join(f"{c} {h / n:.1%}" for c, (h, n) in per_category.items())
        print(f"{mode}: {hits / total:.1%} of {total} tokens ({cats})")


if __name__ == "__main__":
    main()
