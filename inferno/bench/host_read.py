"""How fast this machine reads memory right now: a plain parallel sum of an array far larger than the
caches, on the benchmark's thread count. A figure taken on a shared host means little without it: the
same code's ratio to llama.cpp moves by tens of percent between a quiet host and a busy one
(docs/benchmarks.md), and a decode step's matvecs stream the weights at about the rate this reads.

    python -m inferno.bench.host_read [--threads 2] [--mib 512]
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter

import numpy as np

READ_MIB = 512  # 16 times the largest L3 these benchmarks ran on
PASSES = 5  # timed reads; the median is the rate


def read_rate(threads: int, mib: int = READ_MIB, passes: int = PASSES) -> float:
    """GB/s of a plain sum of `mib` MiB of float64 ones split among `threads` threads (numpy's sum
    releases Python's lock and runs in SIMD); the array is written first, so no page is new memory."""
    data = np.ones((mib << 20) // 8, np.float64)  # its sums are exact: counts far below 2^53
    pieces = np.array_split(data, threads)
    seconds = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(passes + 1):  # the first pass warms the threads: not timed
            t = perf_counter()
            sums = list(pool.map(np.add.reduce, pieces))
            seconds.append(perf_counter() - t)
    if sum(float(s) for s in sums) != data.size:
        raise RuntimeError("host_read: the sum of ones is not their count")
    return data.nbytes / statistics.median(seconds[1:]) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mib", type=int, default=READ_MIB)
    args = parser.parse_args()
    if args.threads < 1 or args.mib < 1:
        parser.error("--threads and --mib must be 1 or more")
    rate = read_rate(args.threads, args.mib)
    print(f"a plain read of {args.mib} MiB on {args.threads} threads: {rate:.1f} GB/s")


if __name__ == "__main__":
    main()
