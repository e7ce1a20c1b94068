"""When a streamed answer's first token reaches the caller, against its prefill's end.

A stream's first token is the prefill's; what a user waits for is its delivery, which the step
loop makes at the end of a step (``engine/batch.py``). This times, for each built-in prompt of a
workload, ``LLM.events``' first event and the request's own prefill time (``stats.prefill_s``), on
the default pair (greedy, the chat template applied as the bench does).

    python scripts/first_token.py --workload code-edit --limit 3 --method combined
"""

from __future__ import annotations

import argparse
import time

from specdecode import LLM, SamplingParams
from specdecode.bench.workloads import limit_per_category, load_workloads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="code-edit", help="a built-in workload (default: %(default)s)")
    p.add_argument("--limit", type=int, default=3, help="prompts of the workload (default: %(default)s)")
    p.add_argument("--method", default="combined", help="speculative method (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default: %(default)s)")
    args = p.parse_args()
    llm = LLM(progress=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    llm.generate("warm up", SamplingParams(max_tokens=4), method=args.method)
    for prompt in limit_per_category(load_workloads([args.workload]), args.limit):
        ids = llm.chat_prompt_ids([{"role": "user", "content": prompt.turns[0]}])
        start = time.perf_counter()
        events = llm.events(ids, params, method=args.method)
        next(events)
        first = time.perf_counter() - start
        output = [e for e in events if e.output is not None][-1].output
        print(f"{prompt.id}: {len(ids)} prompt tokens, prefill {output.stats.prefill_s:.2f} s, "
              f"first token delivered at {first:.2f} s")


if __name__ == "__main__":
    main()
