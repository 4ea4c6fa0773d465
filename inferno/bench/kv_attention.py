"""Decode attention over a 2048-position cache of SmolLM2's shape, for every KV element type, in one
process: the rows are written once, then each type attends with the same query over all 30 layers,
round by round (interleaved), and the min and median of 5 rounds are printed. Times are the process's
CPU time, so other load on a shared machine does not count: run it with NUMBA_NUM_THREADS=1 to
measure one thread's work."""

import time

import numpy as np

from inferno.kv import DTYPES, KVGeometry, make_cache

GEOMETRY = KVGeometry(layers=30, kv_heads=3, heads=9, head_dim=64)
DEPTH, ROUNDS = 2048, 5


def main() -> None:
    rng = np.random.default_rng(0)
    keys, values = (rng.standard_normal((DEPTH, GEOMETRY.kv_width)).astype(np.float32) for _ in range(2))
    query = rng.standard_normal(GEOMETRY.heads * GEOMETRY.head_dim).astype(np.float32)
    caches = {}
    for dtype in DTYPES:
        cache = make_cache("prealloc", GEOMETRY, DEPTH, dtype)
        for layer in range(GEOMETRY.layers):
            cache.write(layer, 0, keys, values)
        cache.commit(DEPTH)
        cache.attend(0, query, DEPTH)  # compile or load the kernels
        caches[dtype] = cache
    times: dict[str, list[float]] = {dtype: [] for dtype in caches}
    for _ in range(ROUNDS):
        for dtype, cache in caches.items():
            t = time.process_time()
            for layer in range(GEOMETRY.layers):
                cache.attend(layer, query, DEPTH)
            times[dtype].append((time.process_time() - t) * 1000)
    for dtype, ms in times.items():
        print(f"{dtype:8s} attention over {DEPTH} positions, {GEOMETRY.layers} layers: CPU "
              f"{min(ms):6.2f} ms (median {sorted(ms)[ROUNDS // 2]:6.2f})")


if __name__ == "__main__":
    main()
