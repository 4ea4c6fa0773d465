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

import functools
import hashlib
from pathlib import Path

import numba
from numba import njit
from numba.core import caching
from numba.core.codegen import get_host_cpu_features
from numba.core.registry import cpu_target

__all__ = ["compiled_for", "njit"]


def compiled_for(feature: str) -> bool:
    """Whether the kernels are compiled for a CPU with `feature` (as "+avx512f"): the features Numba
    compiles for (set below, or by the user), which its kernel cache is keyed by."""
    return feature in (numba.config.CPU_FEATURES or get_host_cpu_features()).split(",")


def full_width_features() -> str | None:
    """The host's CPU features, plus "-prefer-256-bit" where AVX-512 makes that a choice (else None:
    Numba's own default)."""
    features = get_host_cpu_features()
    return f"{features},-prefer-256-bit" if "+avx512f" in features.split(",") else None


@functools.cache
def kernel_sources_digest() -> bytes:
    """A hash of every inferno module that defines or inlines compiled code (njit kernels,
    intrinsics, overloads), read once per process."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_bytes()
        if any(marker in text for marker in KERNEL_MARKERS):
            digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + text)
    return digest.digest()


class _PackageStamp:
    """Numba's cache checks only the source file of the kernel it loads, so a cached kernel outlives a
    change to a kernel it inlined from another module (nibble_dots' intrinsics inside quant's matvec;
    numba issue 1833). For our files the stamp is the hash of all of them: any change to any kernel
    source recompiles every kernel once."""

    def get_source_stamp(self):
        return kernel_sources_digest()

    @classmethod
    def from_function(cls, py_func, py_file):
        inside = Path(py_file).resolve().is_relative_to(PACKAGE)
        return super().from_function(py_func, py_file) if inside else None


class _UserDirStamp(_PackageStamp, caching.UserProvidedCacheLocator):
    pass


class _InTreeStamp(_PackageStamp, caching.InTreeCacheLocator):
    pass


PACKAGE = Path(__file__).resolve().parent.parent
KERNEL_MARKERS = (b"@njit", b"@intrinsic", b"@overload")
caching.CacheImpl._locator_classes[:0] = [_UserDirStamp, _InTreeStamp]

if numba.config.CPU_FEATURES is None and "_toplevel_target_context" not in vars(cpu_target):
    numba.config.CPU_FEATURES = full_width_features()
