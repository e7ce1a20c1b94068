"""``specdecode demo`` (what ``make demo`` runs): the default pair on a few prompts, plain decoding
against each method.

Prints, per prompt and method: tokens/s, speedup over plain decoding, mean acceptance length,
acceptance rate, and whether the output is token-identical to plain greedy decoding. Each method
runs ``--rounds`` times per prompt, in interleaved rounds, and the faster run is shown: one
64-token generation takes a few seconds, and on a shared 2-core host one run of it moves by 10-20%
with the machine (`make demo` three times on one clone printed 0.93x to 1.22x for the same
method and prompt, AMD EPYC Zen 3, 2026-11-27), which a second run of every method, plain
decoding included, narrows.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from specdecode.config import DEFAULT_SPECULATIVE_TOKENS
from specdecode.params import SamplingParams

if TYPE_CHECKING:
    from specdecode.engine.generation import GenerationOutput

PROMPTS = [
    ("code", "Write a Python function `merge_sorted(a, b)` that merges two sorted lists into one "
             "sorted list in O(len(a) + len(b)). Include a docstring."),
    ("code-edit", "Rename the variable `tmp` to `total` in this function and return only the code:\n"
                  "```python\ndef add_all(xs):\n    tmp = 0\n    for x in xs:\n        tmp += x\n"
                  "    return tmp\n```"),
    ("chat", "Explain in three sentences why the sky is blue."),
]
METHODS = ("none", "combined", "draft_model", "ngram")  # combined: the default method


def interleaved_runs(generate: Callable[[str], GenerationOutput], methods: Sequence[str],
                     rounds: int) -> dict[str, list[GenerationOutput]]:
    """``generate(method)`` for every method in turn, ``rounds`` times over, each round starting one
    method further along (a drift of the machine's speed then falls on every method alike, and no
    method always runs first or after the same one); each method's outputs in the order they ran."""
    runs: dict[str, list[GenerationOutput]] = {m: [] for m in methods}
    for r in range(rounds):
        for i in range(len(methods)):
            method = methods[(r + i) % len(methods)]
            runs[method].append(generate(method))
    return runs


def fastest(outputs: Sequence[GenerationOutput]) -> GenerationOutput:
    """The output of the run with the most tokens per second (the first among equals)."""
    return max(outputs, key=lambda o: o.stats.tokens_per_s)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default: %(default)s)")
    p.add_argument("-k", type=int, default=DEFAULT_SPECULATIVE_TOKENS,
                   help="most draft tokens proposed per step (default: %(default)s)")
    p.add_argument("--rounds", type=positive_int, default=2,
                   help="runs of every method per prompt, interleaved; the fastest is shown (default: %(default)s)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.api import LLM

    llm = LLM(num_speculative_tokens=args.k)  # the default method, combined, loads the draft model
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    weights = "GGUF weights run as shipped" if llm.quantize == "native" else f"{llm.quantize or 'float32'} weights"
    print(f"target {llm.model_name} ({weights}), draft {llm.draft_name}, greedy, {args.max_tokens} new "
          f"tokens, K={args.k}, the fastest of {args.rounds} run(s) each\n")
    # Warm-up: a process's first forwards page the weights in from disk; untimed, every method.
    warm = llm.chat_prompt_ids([{"role": "user", "content": "Hi"}])
    for method in METHODS:
        llm.generate(warm, SamplingParams(max_tokens=8), method=method)
    header = f"{'prompt':10} {'method':12} {'tok/s':>7} {'speedup':>8} {'tau':>5} {'accept':>7}  identical"
    print(header)
    print("-" * len(header))
    for category, prompt in PROMPTS:
        ids = llm.chat_prompt_ids([{"role": "user", "content": prompt}])

        def generate(method: str) -> GenerationOutput:
            llm.clear_prefix_cache()  # every run prefills the prompt whole, as plain decoding did
            llm.suffix_history.clear()  # and copies from no earlier answer (an earlier round's of this prompt)
            return llm.generate(ids, params, method=method)[0]

        runs = interleaved_runs(generate, METHODS, args.rounds)
        base = fastest(runs["none"])
        for method in METHODS:
            out = fastest(runs[method])
            s = out.stats
            same = all(o.token_ids == runs["none"][0].token_ids for o in runs[method])
            print(f"{category:10} {method:12} {s.tokens_per_s:7.2f} "
                  f"{s.tokens_per_s / base.stats.tokens_per_s:7.2f}x {s.mean_acceptance_length:5.2f} "
                  f"{s.acceptance_rate:7.0%}  {'yes' if same else 'NO'}", flush=True)
        print(f"  answer: {base.text[:160]!r}{'...' if len(base.text) > 160 else ''}\n")
    return 0
