"""How long the default pair takes to start: importing specdecode, ``LLM()``, a first short answer.

Each run is a fresh process (what `specdecode generate` and `serve` pay at every start), after a
first one that builds whatever the cache lacks. Usage: ``python scripts/startup_time.py [--runs 2]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

ONE_RUN = """
import time
t0 = time.perf_counter()
from specdecode import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(progress=False)
t2 = time.perf_counter()
llm.generate("def fib(n):", SamplingParams(max_tokens=16))
t3 = time.perf_counter()
print(f"import {t1 - t0:.1f} s, LLM() {t2 - t1:.1f} s, first 16 tokens {t3 - t2:.1f} s")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="timed starts after the warm-up start (default 2)")
    args = parser.parse_args()
    subprocess.run([sys.executable, "-c", ONE_RUN], check=True, capture_output=True)  # fills the caches
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", ONE_RUN], check=True, capture_output=True, text=True)
        print(out.stdout.strip())


if __name__ == "__main__":
    main()
