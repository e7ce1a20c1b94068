"""Time plain decoding on the thread that built the model and on another thread, with the first
thread's OpenMP workers alive and given back (``specdecode/engine/openmp.py``): what a server,
which builds its model on one thread and steps it on another, pays for a second pool.

    python scripts/thread_pools.py [--tokens 96] [--rounds 5]

Each round runs, in turn: a generation on this thread (which starts its pool again), one on a new
thread while this thread's pool is alive, and one on a new thread after this thread gave its pool
back. Prints each case's median milliseconds per token.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from specdecode import LLM, SamplingParams
from specdecode.engine.openmp import release_pool

PROMPT = "Write a Python function that parses an ISO 8601 date string and returns a datetime. Explain it."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96, help="tokens per generation (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the three cases (default: %(default)s)")
    args = ap.parse_args()
    llm = LLM(method="none")
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    messages = [{"role": "user", "content": PROMPT}]
    times: dict[str, list[float]] = {"this thread": [], "another thread, this one's pool alive": [],
                                     "another thread, this one's pool given back": []}

    def run(case: str) -> None:
        start = time.perf_counter()
        llm.chat(messages, params)
        times[case].append((time.perf_counter() - start) / args.tokens * 1e3)

    def on_new_thread(case: str) -> None:
        t = threading.Thread(target=run, args=(case,))
        t.start()
        t.join()

    run("this thread")  # warm-up, not kept
    times["this thread"].clear()
    for _ in range(args.rounds):
        run("this thread")
        on_new_thread("another thread, this one's pool alive")
        if not release_pool():
            raise SystemExit("this process's OpenMP runtime cannot give a thread's workers back (not libgomp 9+)")
        on_new_thread("another thread, this one's pool given back")
    for case, ms in times.items():
        print(f"{case:45s} median {statistics.median(ms):5.1f} ms/token  ({', '.join(f'{m:.1f}' for m in ms)})")


if __name__ == "__main__":
    main()
