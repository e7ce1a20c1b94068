"""``specdecode demo`` (what ``make demo`` runs): the default pair on a few prompts, plain decoding
against each method.

Prints, per prompt and method: tokens/s, speedup over plain decoding, mean acceptance length,
acceptance rate, and whether the output is token-identical to plain greedy decoding.
"""

from __future__ import annotations

import argparse

from specdecode.config import DEFAULT_SPECULATIVE_TOKENS
from specdecode.params import SamplingParams

PROMPTS = [
    ("code", "Write a Python function `merge_sorted(a, b)` that merges two sorted lists into one "
             "sorted list in O(len(a) + len(b)). Include a docstring."),
    ("code-edit", "Rename the variable `tmp` to `total` in this function and return only the code:\n"
                  "```python\ndef add_all(xs):\n    tmp = 0\n    for x in xs:\n        tmp += x\n"
                  "    return tmp\n```"),
    ("chat", "Explain in three sentences why the sky is blue."),
]
METHODS = ("none", "combined", "draft_model", "ngram")  # combined: the default method


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default: %(default)s)")
    p.add_argument("-k", type=int, default=DEFAULT_SPECULATIVE_TOKENS,
                   help="most draft tokens proposed per step (default: %(default)s)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.api import LLM

    llm = LLM(num_speculative_tokens=args.k)  # the default method, combined, loads the draft model
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    weights = "GGUF weights run as shipped" if llm.quantize == "native" else f"{llm.quantize or 'float32'} weights"
    print(f"target {llm.model_name} ({weights}), draft {llm.draft_name}, greedy, {args.max_tokens} new "
          f"tokens, K={args.k}\n")
    # Warm-up: a process's first forwards page the weights in from disk; untimed, every method.
    warm = llm.chat_prompt_ids([{"role": "user", "content": "Hi"}])
    for method in METHODS:
        llm.generate(warm, SamplingParams(max_tokens=8), method=method)
    header = f"{'prompt':10} {'method':12} {'tok/s':>7} {'speedup':>8} {'tau':>5} {'accept':>7}  identical"
    print(header)
    print("-" * len(header))
    for category, prompt in PROMPTS:
        ids = llm.chat_prompt_ids([{"role": "user", "content": prompt}])
        llm.clear_prefix_cache()  # every method prefills the prompt whole, as plain decoding did
        [base] = llm.generate(ids, params, method="none")
        for method in METHODS:
            llm.clear_prefix_cache()
            out = base if method == "none" else llm.generate(ids, params, method=method)[0]
            s = out.stats
            same = out.token_ids == base.token_ids
            print(f"{category:10} {method:12} {s.tokens_per_s:7.2f} "
                  f"{s.tokens_per_s / base.stats.tokens_per_s:7.2f}x {s.mean_acceptance_length:5.2f} "
                  f"{s.acceptance_rate:7.0%}  {'yes' if same else 'NO'}", flush=True)
        print(f"  answer: {base.text[:160]!r}{'...' if len(base.text) > 160 else ''}\n")
    return 0
