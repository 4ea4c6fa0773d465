"""A prefill's BLAS work shared between threads: each of the threads the kernels may use now (Numba's
count for the calling thread) runs its own share, calling BLAS on one thread.

Why not BLAS's own threads: a prefill alternates BLAS products with Numba kernels, and two pools taking
turns left each pool's idle threads spinning against the other's working ones. Worse, OpenBLAS reads
how long its idle threads spin when it loads, so in a program that imported numpy before inferno
(inferno/__init__.py shortens the spin) they spun long after every product (docs/LOG.md has the
figures). With BLAS on one thread per share, its pool never wakes. The Numba kernels a share calls
run serially and release Python's lock (nogil)."""

from __future__ import annotations

import heapq
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numba
from threadpoolctl import ThreadpoolController

_HELPER = "inferno-share"  # the helper threads' name prefix
_helpers: ThreadPoolExecutor | None = None  # the threads beside the caller's
_blas: ThreadpoolController | None = None


# Work of fewer float operations than this runs in the calling thread: waking a helper takes about as
# long as half of it (docs/LOG.md).
SHARED_FROM_FLOP = 20e6


def threads_for(n: int, flop: float = math.inf) -> int:
    """How many threads share n items, `flop` float operations in all, now."""
    return 1 if flop < SHARED_FROM_FLOP else max(1, min(n, numba.get_num_threads()))


def in_spans(work: Callable[[int, int], None], n: int, flop: float = math.inf) -> None:
    """work(lo, hi) over items 0..n in equal contiguous spans, one per thread (items of equal cost)."""
    threads = threads_for(n, flop)
    _run([lambda k=k: work(k * n // threads, (k + 1) * n // threads) for k in range(threads)])


def dealt(work: Callable[[int], None], costs: Sequence[float], flop_per_cost: float = math.inf) -> None:
    """work(i) for every item i, the items dealt largest first, each to the thread with the least work
    so far; a thread runs its items in their order. Item i is costs[i] * flop_per_cost float operations."""
    threads = threads_for(len(costs), sum(costs) * flop_per_cost)
    loads = [(0.0, k) for k in range(threads)]
    shares: list[list[int]] = [[] for _ in range(threads)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, k = heapq.heappop(loads)
        shares[k].append(i)
        heapq.heappush(loads, (load + costs[i], k))
    for share in shares:
        share.sort()
    _run([lambda share=share: [work(i) for i in share] for share in shares])


def _run(shares: list[Callable[[], object]]) -> None:
    """Each share in its own thread (the first in the caller's), BLAS on one thread meanwhile. Called
    from inside a share, the shares run one after another in that thread: the helpers are all busy."""
    global _helpers, _blas
    if threading.current_thread().name.startswith(_HELPER):
        for share in shares:
            share()
        return
    if _blas is None:
        _blas = ThreadpoolController()
    with _blas.limit(limits=1, user_api="blas"):
        if len(shares) > 1 and _helpers is None:
            _helpers = ThreadPoolExecutor(max(1, numba.config.NUMBA_NUM_THREADS - 1), _HELPER)
        helping = [_helpers.submit(share) for share in shares[1:]] if len(shares) > 1 else []
        shares[0]()
        for done in helping:
            done.result()
