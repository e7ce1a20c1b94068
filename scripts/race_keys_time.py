"""Time one position's race keys over the target's vocabulary (``sample/race.py``): the way
``RaceKeys`` draws them against ``exponential_``, median of ``--repeat``.

    python scripts/race_keys_time.py [--vocab 151936] [--repeat 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from specdecode.sample.race import RaceKeys


def median_ms(draw: Callable[[int], object], repeat: int) -> float:
    times = []
    for position in range(repeat):
        start = time.perf_counter()
        draw(position)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936, help="keys per position (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=200, help="positions timed (default: %(default)s)")
    args = p.parse_args()
    keys = RaceKeys(seed=0)
    exponential = median_ms(lambda i: torch.empty(args.vocab).exponential_(generator=torch.Generator().manual_seed(i)),
                            args.repeat)
    race = median_ms(lambda i: keys.at(i, args.vocab), args.repeat)
    print(f"{args.vocab} keys a position: RaceKeys {race:.2f} ms, exponential_ {exponential:.2f} ms")


if __name__ == "__main__":
    main()
