"""OpenAI's predicted-outputs example on the default pair: a 60-line file with one function renamed,
asked with and without the file as the prediction, greedy; the answers must be identical.

    python scripts/prediction_speed.py [--method combined] [--repeat 2] [--max-tokens 700]

(``specdecode bench --workload file-edit --prediction`` measures the same beside other methods.)

Prints tokens/s of each (the best of ``--repeat``, prefill included), the speed-up, tau and the
prediction's kept and refused drafts. Without a prediction it runs ``--method`` as the server
would by default; with one, the prediction is offered beside that method's own drafts.
"""

from __future__ import annotations

import argparse
import dataclasses

from specdecode.api import LLM
from specdecode.config import DEFAULT_MODEL
from specdecode.bench.prompts_code import SHOP_FILE, FILE_EDIT
from specdecode.params import SamplingParams

FILE, ASK = SHOP_FILE, FILE_EDIT[0]  # the bench's file-edit workload, prompt 0

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the target (default: %(default)s)")
    ap.add_argument("--method", default=None, help="the drafting method (default: the machine's default)")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each, best kept (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=700, help="(default: %(default)s)")
    args = ap.parse_args()
    llm = LLM(args.model, method=args.method, progress=False)
    ids = llm.chat_prompt_ids([{"role": "user", "content": ASK}])
    plain_params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    predicted_params = dataclasses.replace(plain_params, prediction="```python\n" + FILE + "```")
    llm.generate(ids, SamplingParams(max_tokens=4))  # pages the weights in
    best = {}
    for _ in range(args.repeat):
        for name, params in (("without", plain_params), ("with", predicted_params)):
            llm.clear_prefix_cache()  # each run prefills the prompt whole
            out = llm.generate(ids, params)[0]
            if name not in best or out.stats.tokens_per_s > best[name].stats.tokens_per_s:
                best[name] = out
    without, with_ = best["without"], best["with"]
    assert with_.token_ids == without.token_ids, "a prediction changed the answer"
    s = with_.stats
    print(f"method {without.method}, {len(ids)} prompt tokens, {len(without.token_ids)} answer tokens, identical: yes")
    print(f"without prediction: {without.stats.tokens_per_s:.2f} tok/s (tau {without.stats.mean_acceptance_length:.2f})")
    print(f"with prediction:    {s.tokens_per_s:.2f} tok/s (tau {s.mean_acceptance_length:.2f}), prediction tokens "
          f"kept {s.prediction_accepted}, refused {s.prediction_rejected}")
    print(f"speed-up: {s.tokens_per_s / without.stats.tokens_per_s:.2f}x")


if __name__ == "__main__":
    main()
