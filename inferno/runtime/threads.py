"""How many threads the kernels run on: fixed by `--threads N`, or chosen step by step by measuring.

The kernels' threads meet at a barrier after every parallel loop, over a hundred times a decode step.
On a quiet machine each thread has a core and two threads beat one. When other processes want the
cores, a thread that is descheduled holds the others up at every barrier, and a step on all threads
becomes many times slower than one on a single thread. Which count is faster is a fact about the
machine at the moment, so by default it is measured. The first count comes from how busy other
processes kept the CPUs while the command started (its imports and loading); then the scheduler times
every step, now and then
runs one step on a neighbouring count (a probe), and keeps whichever computes a token faster. Probes
cost time (a probe on the worse count is a slow step), so they are spaced to cost at most PROBE_COST of
it, judged from the last probe's ratio; they come soon again when the current count's steps turn slow
(load arrived).

One governor serves the process (the load is the machine's, not a request's): `GOVERNOR`. Numba's
thread count is per calling thread, so it is set before each step in the thread that steps; the BLAS
behind numpy has one count for the process, set when the count changes.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter

import numba

from inferno import STARTED_CPU, machine_cpu

FIRST_PROBE = 1  # steps timed on the current count, in a class of step, before it is challenged
PROBE_EVERY = (16, 256)  # bounds on the steps between probes
PROBE_COST = 0.03  # the share of time that probing on a slower count may cost
WINDOW = 8  # recent steps kept per (class of step, thread count)
WIN = 0.85  # a probe wins when its token takes at most this share of the current count's
MOVED = 1.5  # the current count's time above its usual by this factor, three steps running: load came


class ThreadGovernor:
    """`with governor.step(tokens):` around each forward; `fix(n)` for a count that never changes."""

    def __init__(self, most: int, apply: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = perf_counter,
                 others: Callable[[], float | None] = lambda: _others_since_start()):
        """most: the pool's size; apply(threads) sets the count (default: Numba's for the calling
        thread and the BLAS's); clock: seconds, to time steps; others(): the CPUs other processes
        kept busy since start-up (None: unknown)."""
        self.most = most  # Numba's NUMBA_NUM_THREADS: affinity and CPU quota applied (inferno/__init__.py)
        self._apply = apply or self._set_pools
        self._clock = clock
        self.others = others  # read once, by settle()
        self._settled = False
        self.fixed: int | None = None
        self.current = most
        self.notice: Callable[[str], None] | None = None  # told once when load first costs threads
        self._ladder = _ladder(most)
        self._seconds: dict[tuple[int, int], deque[float]] = {}  # seconds a token of recent steps
        self._steps = 0
        self._interval = PROBE_EVERY[0]
        self._probe_at = 0
        self._moved = 0
        self._probe_up = False  # which way the next probe goes, where both are open
        self._blas_threads: int | None = None
        self._noticed = False

    def fix(self, threads: int | None) -> None:
        """Run every step on `threads` (None: measure again)."""
        self.fixed = threads
        if threads is not None:
            self._apply(threads)

    def settle(self) -> int:
        """Decide the first count (once) and set it for the calling thread: the model's warm-up runs
        on it too. All threads unless other processes kept CPUs busy since start-up."""
        if self.fixed is None and not self._settled:
            self._settled = True
            others = self.others()
            if others is not None:
                free = max(1, (os.cpu_count() or self.most) - round(others))
                first = next(n for n in self._ladder if n <= free)
                if first < self.most:
                    self.current = first
                    # probing more threads is a slow step while the load lasts: not at once
                    self._probe_at = self._steps + PROBE_EVERY[0] * 4
                    self._say(f"other processes kept {others:.1f} CPUs busy as it started: the kernels "
                              f"run on {first} of {self.most} threads")
        self._apply(self.threads)
        return self.threads

    @property
    def threads(self) -> int:
        """The count the next ordinary step runs on."""
        return self.fixed or self.current

    @contextmanager
    def step(self, tokens: int) -> Iterator[int]:
        """Run the enclosed forward of `tokens` tokens on the count chosen for it (yielded); time it."""
        size = max(1, tokens).bit_length()  # steps of alike size are compared: 1, 2-3, 4-7, ... tokens
        threads = self._choose(size)
        self._apply(threads)
        start = self._clock()
        yield threads
        if self.fixed is None:
            self._learn(size, threads, (self._clock() - start) / max(1, tokens))

    # -- choosing ----------------------------------------------------------------------------------

    def _choose(self, size: int) -> int:
        if self.fixed is not None:
            return self.fixed
        if not self._settled:
            self.settle()
        ready = len(self._seconds.get((size, self.current), ())) >= FIRST_PROBE
        if len(self._ladder) > 1 and ready and self._steps >= self._probe_at:
            return self._neighbour()
        return self.current

    def _neighbour(self) -> int:
        i = self._ladder.index(self.current)  # the ladder runs from most threads down to one
        if (self._probe_up and i > 0) or i == len(self._ladder) - 1:
            return self._ladder[i - 1]
        return self._ladder[i + 1]

    def _learn(self, size: int, threads: int, seconds: float) -> None:
        self._steps += 1
        mine = self._seconds.setdefault((size, threads), deque(maxlen=WINDOW))
        if threads != self.current:
            reference = statistics.median(self._seconds[size, self.current])
            if seconds <= WIN * reference:
                self._switch(threads, seconds, reference)
                self._interval = _spacing(reference / seconds)  # probing back costs that ratio
            else:
                self._interval = max(min(2 * self._interval, PROBE_EVERY[1]), _spacing(seconds / reference))
                self._probe_up = not self._probe_up
            self._probe_at = self._steps + self._interval
        elif len(mine) >= FIRST_PROBE and self.current > 1:
            # Three steps running well above the usual: load arrived; challenge the count with fewer
            # threads soon. (A count getting faster is no sign: on a shared core one thread's steps
            # swing 2x with the OS's time slices, and load leaving is found by the spaced probes.)
            self._moved = self._moved + 1 if seconds > statistics.median(mine) * MOVED else 0
            if self._moved >= 3:
                self._moved = 0
                mine.clear()
                self._probe_up = False
                self._interval = PROBE_EVERY[0]
                self._probe_at = self._steps + FIRST_PROBE
        mine.append(seconds)

    def _switch(self, threads: int, seconds: float, reference: float) -> None:
        before, self.current = self.current, threads
        if threads < before:
            self._say(f"other processes are using the cores: the kernels now run on {threads} of "
                      f"{self.most} threads ({reference / seconds:.1f}x faster a token than on {before})")

    def _say(self, message: str) -> None:
        if not self._noticed and self.notice is not None:
            self._noticed = True
            self.notice(f"{message}; --threads N fixes the count")

    # -- applying ----------------------------------------------------------------------------------

    def _set_pools(self, threads: int) -> None:
        numba.set_num_threads(threads)  # this thread's count: cheap, so every step
        if threads != self._blas_threads:
            from threadpoolctl import threadpool_limits

            threadpool_limits(threads, user_api="blas")
            self._blas_threads = threads


def _others_since_start() -> float | None:
    """CPUs that processes other than this one kept busy, on average, since inferno was imported."""
    now = machine_cpu()
    if STARTED_CPU is None or now is None or now[2] - STARTED_CPU[2] < 0.1:
        return None  # too short a time to tell (10 ms ticks)
    busy, own, wall = (b - a for a, b in zip(STARTED_CPU, now, strict=True))
    return max(0.0, (busy - own) / wall)


def _spacing(ratio: float) -> int:
    """Steps between probes when a probe takes `ratio` times an ordinary step: it costs PROBE_COST."""
    return min(PROBE_EVERY[1], max(PROBE_EVERY[0], math.ceil((ratio - 1) / PROBE_COST)))


def _ladder(most: int) -> list[int]:
    """The counts tried, most first: all threads, then halves down to one (8: 8, 4, 2, 1)."""
    ladder = [most]
    while ladder[-1] > 1:
        ladder.append(ladder[-1] // 2)
    return ladder


GOVERNOR = ThreadGovernor(numba.config.NUMBA_NUM_THREADS)
