"""inferno: run GGUF language models on the CPU and make the KV cache visible."""

import os
from time import monotonic, perf_counter

__version__ = "0.1.0"
IMPORTED_AT = perf_counter()  # when the first inferno module was imported: a command's start-up begins here

# How long the idle workers of our two thread pools busy-wait before sleeping. Both are read when the
# library loads (OpenMP at Numba's first parallel kernel, OpenBLAS at numpy's import), hence here,
# before any inferno module imports numpy; a value the user set wins (figures: docs/LOG.md).
# - Numba's OpenMP workers: a decode step launches over a hundred parallel loops microseconds of Python
#   apart. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) made decode slower on a quiet machine, libgomp's
#   default spin (300,000) many times slower when other processes wanted the cores; 30,000 outlasts
#   the Python between two loops.
# - OpenBLAS's workers spin about 0.1 s after each product by default, holding the cores that the
#   Numba kernels between a prefill's products need; 2^16 ticks does not.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")


def cpu_quota(root: str = "/sys/fs/cgroup") -> int | None:
    """Whole CPUs a cgroup's quota allows this process (a container's `--cpus`; at least 1), or None
    when it sets none. Read as automaxprocs does: cgroup v2's cpu.max, else v1's cfs quota and period."""
    v1 = f"{root}/cpu/cpu.cfs_quota_us", f"{root}/cpu/cpu.cfs_period_us"
    for path, split in ((f"{root}/cpu.max", None), v1):
        try:
            with open(path) as f:
                fields = f.read().split()
            if split is not None:
                with open(split) as f:
                    fields += f.read().split()
            quota, period = int(fields[0]), int(fields[1])
        except (OSError, ValueError, IndexError):  # absent, "max" (no quota), or unreadable
            continue
        return max(1, quota // period) if quota > 0 and period > 0 else None
    return None


# Numba sizes its pool from the CPUs this process may run on (affinity), not from a CPU quota; a pool
# larger than the quota is throttled mid-step, which costs as much as a busy neighbour. OpenBLAS sizes
# its own from the machine.
if "NUMBA_NUM_THREADS" not in os.environ and hasattr(os, "sched_getaffinity"):
    _allowed = min(len(os.sched_getaffinity(0)), cpu_quota() or os.cpu_count() or 1)
    if _allowed < (os.cpu_count() or 1):
        os.environ["NUMBA_NUM_THREADS"] = str(_allowed)
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(_allowed))


def machine_cpu() -> tuple[float, float, float] | None:
    """(CPU seconds every CPU has been busy, CPU seconds of this process, monotonic seconds), or None
    without /proc/stat: two of them tell how busy other processes kept the CPUs in between."""
    try:
        with open("/proc/stat") as f:  # cpu user nice system idle iowait irq softirq steal (guest...)
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    own = os.times()
    busy = sum(ticks) - ticks[3] - ticks[4]  # a hypervisor's steal counts as busy: the CPU was not ours
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, monotonic()


STARTED_CPU = machine_cpu()  # at import; the thread governor's first count compares against it
