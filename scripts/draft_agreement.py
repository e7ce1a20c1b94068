"""How often a quantized draft's top choice matches the target's greedy token, teacher-forced
over answers the target already gave (the ``none`` rows of a bench's results.jsonl).

This agreement is the draft's per-token acceptance under greedy verification, measured in a
minute without timing noise, so quantization schemes can be compared before a bench run. Every
position of each first-turn answer counts, with the chat-rendered prompt as context.

With ``--vocab``, the agreement of a draft whose LM head keeps only the N top-ranked tokens of
the shipped ranking (``drafters/draft_vocab.py``) is computed for each N from the same forward:
the restricted logits are the full logits' columns at the kept ids (tests/test_draft_vocab.py),
so the restricted argmax is the argmax over those columns. Measure it on answers the ranking was
not calibrated on (``scripts/draft_vocab_rank.py --prompts bench`` writes such rows).

    python scripts/draft_agreement.py bench-results/s11-all/results.jsonl --quantize int8,int4
    python scripts/draft_agreement.py held_out.jsonl --quantize int4 --vocab 8192,16384,32768,65536,full
    python scripts/draft_agreement.py held_out.jsonl --quantize int4 --vocab 32768 --ranking a.json --ranking b.json

With ``--traces PATH``, it also writes, for the first ``--quantize`` mode and the last ``--vocab``
size, each answer's agreement position by position and the draft's probability of its own top
token there (one JSON line per prompt): the greedy drafts a speculation policy would see, which
``scripts/policy_sim.py`` replays.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdecode.bench.workloads import WORKLOAD_NAMES, load_workloads
from specdecode.drafters.draft_vocab import load_ranking
from specdecode.models.catalog import resolve_model
from specdecode.models.decoder import Decoder
from specdecode.tokenizer import Tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="a bench's results.jsonl with rows of method none")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--quantize", default="int8,int4", help="comma-separated: none, int8, int4")
    p.add_argument("--vocab", default="full", help="comma-separated head sizes N (full: the whole head)")
    p.add_argument("--traces", type=Path, help="write per-position agreement and draft confidence here (JSON lines)")
    p.add_argument("--ranking", type=Path, action="append",
                   help="a ranking file to compare (repeatable; default: the shipped one): each --vocab size is "
                        "measured per file, printed as N@FILE")
    p.add_argument("--with-context", action="store_true",
                   help="also measure each restricted head extended by the request's own tokens: N+ctx adds the "
                        "prompt's ids, N+hist also the answer's ids before each position")
    args = p.parse_args()
    rankings = {path.name: load_ranking(path) for path in args.ranking} if args.ranking else {"": load_ranking()}
    sizes, kept = [], {}
    for n in (s.strip() for s in args.vocab.split(",")):
        for name, ranking in (rankings.items() if n != "full" else [("", None)]):
            label = f"{n}@{name}" if name else n
            sizes.append(label)
            kept[label] = None if ranking is None else ranking.top(int(n))
            if ranking is not None and args.with_context:
                sizes += [f"{label}+ctx", f"{label}+hist"]
    rows = [json.loads(line) for line in args.results.read_text().splitlines()]
    answers = {r["prompt_id"]: r["token_ids"] for r in rows if r["method"] == "none" and r["turn"] == 0}
    prompts = {pr.id: pr for pr in load_workloads(list(WORKLOAD_NAMES)) if pr.id in answers}
    path = resolve_model(args.draft)
    tokenizer = Tokenizer.from_dir(path)
    traces = []
    for mode in args.quantize.split(","):
        model = Decoder.from_dir(path, role="draft", quantize=None if mode == "none" else mode)
        hits = {s: 0 for s in sizes}
        covered = {s: 0 for s in sizes}  # the target's token is in the head
        total = 0
        per_category: dict[str, list[int]] = {}
        for pid, answer in answers.items():
            context = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompts[pid].turns[0]}]))
            cache = model.new_cache(len(context) + len(answer) + 8)
            model.forward(torch.tensor(context[:-1]), cache, last_only=True)
            logits = model.forward(torch.tensor(context[-1:] + answer[:-1]), cache)
            truth = torch.tensor(answer)
            for s in sizes:
                ids = kept.get(s)
                if s.endswith(("+ctx", "+hist")):
                    allowed = _allowed(kept[s.rsplit("+", 1)[0]], context, answer, logits.shape[-1], s.endswith("+hist"))
                    scores = logits.masked_fill(~allowed, float("-inf"))
                    guess = scores.argmax(-1)
                    in_head = allowed.gather(1, truth[:, None])[:, 0]
                else:
                    scores = logits if ids is None else logits[:, ids]
                    guess = logits.argmax(-1) if ids is None else ids[scores.argmax(-1)]
                    in_head = torch.ones_like(truth, dtype=torch.bool) if ids is None else torch.isin(truth, ids)
                agree = int((guess == truth).sum())
                hits[s] += agree
                covered[s] += int(in_head.sum())
                if s == sizes[-1]:
                    slot = per_category.setdefault(prompts[pid].category, [0, 0])
                    slot[0] += agree
                    slot[1] += len(answer)
                    if args.traces and mode == args.quantize.split(",")[0]:
                        probs = scores.float().softmax(-1)
                        traces.append({"prompt_id": pid, "category": prompts[pid].category, "prompt_tokens": len(context),
                                       "match": (guess == truth).int().tolist(),
                                       "p": [round(x, 4) for x in probs.max(-1).values.tolist()]})
            total += len(answer)
        for s in sizes:
            print(f"{mode} vocab {s}: agreement {hits[s] / total:.2%} of {total} tokens, "
                  f"target token in the head {covered[s] / total:.2%}")
        cats = ", ".join(f"{c} {h / n:.1%}" for c, (h, n) in per_category.items())
        print(f"{mode} vocab {sizes[-1]} by category: {cats}")
    if args.traces:
        args.traces.write_text("".join(json.dumps(t) + "\n" for t in traces))
        print(f"traces of {len(traces)} answers: {args.traces}")


def _allowed(ids: torch.Tensor, context: list[int], answer: list[int], vocab: int, history: bool) -> torch.Tensor:
    """[len(answer), vocab] bool: the ids a head extended by the request's tokens covers at each
    position (the prompt's; with ``history`` also the answer's tokens before that position)."""
    base = torch.zeros(vocab, dtype=torch.bool)
    base[ids] = True
    base[torch.tensor(context)] = True
    allowed = base.repeat(len(answer), 1)
    if history:
        for i, token in enumerate(answer[:-1]):
            allowed[i + 1:, token] = True
    return allowed


if __name__ == "__main__":
    main()
