"""What every Numba kernel is compiled for: the host CPU at its full vector width.

LLVM's tuning for Intel's AVX-512 cores prefers 256-bit vectors (wide ones can lower the clock), so
Numba's loops there ran on ymm registers, half the width the CPU has. Our kernels are short runs of
vector work on bytes streaming from memory, where the full width pays (docs/LOG.md has the figures).
CPUs without AVX-512 are left as Numba sees them.

Numba builds its code generator when the first kernel is defined, so the target must be set before
that: the kernel modules take `njit` from here. NUMBA_CPU_FEATURES, when the user sets it, wins; and
if something in the process compiled with Numba before inferno was imported, the generator exists
already and is left as it is (changing the features then would only mislabel the cached kernels).
"""

import numba
from numba import njit
from numba.core.codegen import get_host_cpu_features
from numba.core.registry import cpu_target

__all__ = ["njit"]


def full_width_features() -> str | None:
    """The host's CPU features, plus "-prefer-256-bit" where AVX-512 makes that a choice (else None:
    Numba's own default)."""
    features = get_host_cpu_features()
    return f"{features},-prefer-256-bit" if "+avx512f" in features.split(",") else None


if numba.config.CPU_FEATURES is None and "_toplevel_target_context" not in vars(cpu_target):
    numba.config.CPU_FEATURES = full_width_features()
