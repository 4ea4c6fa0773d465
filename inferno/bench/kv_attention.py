"""Decode attention over a 2048-position cache of SmolLM2's shape, for every KV element type, in one
process: the rows are written once, then each type attends with the same query over all 30 layers,
round by round (interleaved), and the min and median of the rounds are printed. Times are the
process's CPU time, so other load on a shared machine does not count: run it with NUMBA_NUM_THREADS=1
to measure one thread's work.

Each element type runs in a prealloc cache and, when the paged layout holds it, in a lone paged cache
(`PagedKVCache` with its own pool of 16-position blocks, filled to the same depth): the one attention
kernel of both (blocks.attend_tables) through each layout's block table, and paged's time against
prealloc's. Last, the fixed cost of one call: one layer at depth 16, where the positions cost little.

    python -m inferno.bench.kv_attention [DTYPE ...] [--rounds N] [--layouts prealloc,paged]

Written against the cache interface only, so the same file measures an older checkout too
(`PYTHONPATH=<old tree> python inferno/bench/kv_attention.py`): layouts or element types that tree does
not have are left out.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from inferno.kv import DTYPES, KVGeometry, cache_class, make_cache

GEOMETRY = KVGeometry(layers=30, kv_heads=3, heads=9, head_dim=64)
DEPTH, ROUNDS, PASSES = 2048, 5, 3  # PASSES: passes over the 30 layers timed together in a round
SHORT, CALLS = 16, 2000  # the fixed cost per call: CALLS calls at depth SHORT, one layer
LAYOUTS = ("prealloc", "paged")


def filled(layout: str, dtype: str, keys: np.ndarray, values: np.ndarray):
    """A cache of `layout` holding keys, values in every layer, committed."""
    depth = keys.shape[0]
    cache = make_cache(layout, GEOMETRY, depth, dtype)
    for layer in range(GEOMETRY.layers):
        cache.write(layer, 0, keys, values)
    cache.commit(depth)
    return cache


def cpu_ms(cache, query: np.ndarray, depth: int, layers: int, passes: int) -> float:
    """CPU milliseconds of one pass of `query` over `layers` layers at `depth` (mean of `passes`)."""
    t = time.process_time()
    for _ in range(passes):
        for layer in range(layers):
            cache.attend(layer, query, depth)
    return (time.process_time() - t) * 1000 / passes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m inferno.bench.kv_attention",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("dtypes", nargs="*", metavar="DTYPE", help="element types (default: all)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds (default {ROUNDS})")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated (default: %(default)s)")
    args = parser.parse_args(argv)
    rounds = max(args.rounds, 1)
    dtypes = [d for d in (args.dtypes or DTYPES) if d in DTYPES]
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]

    rng = np.random.default_rng(0)
    keys, values = (rng.standard_normal((DEPTH, GEOMETRY.kv_width)).astype(np.float32) for _ in range(2))
    query = rng.standard_normal(GEOMETRY.heads * GEOMETRY.head_dim).astype(np.float32)
    caches, short = {}, {}
    for layout in layouts:
        for dtype in dtypes:
            if dtype not in cache_class(layout).dtypes:
                continue
            cache = caches[layout, dtype] = filled(layout, dtype, keys, values)
            cache.attend(0, query, DEPTH)  # compile or load the kernels
            short[layout, dtype] = filled(layout, dtype, keys[:SHORT], values[:SHORT])

    times: dict[tuple[str, str], list[float]] = {key: [] for key in caches}
    calls: dict[tuple[str, str], list[float]] = {key: [] for key in caches}
    for _ in range(rounds):
        for key, cache in caches.items():
            times[key].append(cpu_ms(cache, query, DEPTH, GEOMETRY.layers, PASSES))
            calls[key].append(cpu_ms(short[key], query, SHORT, 1, CALLS) * 1000)

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    for (layout, dtype), ms in times.items():
        versus = ""
        if layout != "prealloc" and ("prealloc", dtype) in times:
            versus = f", {median(ms) / median(times['prealloc', dtype]):.3f}x prealloc"
        print(f"{dtype:8s} {'' if layout == 'prealloc' else layout + ' '}attention over {DEPTH} positions, "
              f"{GEOMETRY.layers} layers: CPU {min(ms):6.2f} ms (median {median(ms):6.2f}){versus}")
    for (layout, dtype), us in calls.items():
        print(f"{dtype:8s} {layout:8s} one call at depth {SHORT}: CPU {min(us):5.2f} us "
              f"(median {median(us):5.2f})")


if __name__ == "__main__":
    main()
