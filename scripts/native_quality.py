"""What running a GGUF natively costs in quality: the native target against its float32 reference.

    python scripts/native_quality.py [--model NAME] [--workload all] [--limit 1] [--max-tokens 64]

For each prompt the float32 model (the GGUF dequantized, ``--quantize none``) answers greedily;
then both models read prompt + answer in one teacher-forced pass, and over the answer positions
this prints how often their top-1 tokens agree and the mean KL(float32 || native) in nats. The
two differ only by the native path's int8 rounding of activations (the weights are the same).
"""

from __future__ import annotations

import argparse
import math

import torch

from specdecode import LLM, SamplingParams
from specdecode.bench.workloads import limit_per_category, load_workloads, parse_workload_names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--workload", default="all")
    ap.add_argument("--limit", type=int, default=1, help="prompts per category")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    reference = LLM(args.model, quantize="none", progress=False)
    native = LLM(args.model, quantize="native", progress=False)
    prompts = limit_per_category(load_workloads(parse_workload_names(args.workload)), args.limit)
    total_agree = total_kl = total_n = 0.0
    print(f"{'category':16} {'tokens':>6} {'top-1 agree':>11} {'mean KL':>9}")
    for prompt in prompts:
        ids = reference.chat_prompt_ids([{"role": "user", "content": prompt.turns[0]}])
        answer = reference.engine.generate(ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
        tokens = torch.tensor(ids + answer.token_ids)
        rows = slice(len(ids) - 1, len(tokens) - 1)  # the positions that predict the answer
        logits = [m.target.forward(tokens, m.target.new_cache(len(tokens)))[rows] for m in (reference, native)]
        p_log, q_log = (torch.log_softmax(x.double(), -1) for x in logits)
        kl = (p_log.exp() * (p_log - q_log)).sum(-1)
        agree = (logits[0].argmax(-1) == logits[1].argmax(-1)).double()
        n = len(answer.token_ids)
        total_agree, total_kl, total_n = total_agree + agree.sum().item(), total_kl + kl.sum().item(), total_n + n
        print(f"{prompt.category:16} {n:6d} {agree.mean().item():11.1%} {kl.mean().item():9.2e}")
    if total_n:
        print(f"{'all':16} {int(total_n):6d} {total_agree / total_n:11.1%} {total_kl / total_n:9.2e}"
              f"  (perplexity ratio exp(KL) {math.exp(total_kl / total_n):.4f})")


if __name__ == "__main__":
    main()
