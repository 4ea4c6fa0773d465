"""The process-wide settings inferno makes before its kernels and libraries load."""

import os
import subprocess
import sys

import numpy as np
from numba.core.codegen import get_host_cpu_features

from inferno.kernels import jit


def test_kernels_compile_at_full_vector_width_where_avx512_offers_a_choice():
    """A loop LLVM vectorizes runs on 512-bit registers wherever the CPU has them (LLVM's own tuning
    for these CPUs picks 256 bits); elsewhere Numba's default target is left alone."""
    avx512 = "+avx512f" in get_host_cpu_features().split(",")
    assert (jit.full_width_features() is not None) == avx512

    @jit.njit(fastmath=True)
    def dot(a, b):
        total = np.float32(0)
        for i in range(a.size):
            total += a[i] * b[i]
        return total

    x = np.ones(1000, np.float32)
    assert dot(x, x) == 1000
    if avx512 and "NUMBA_CPU_FEATURES" not in os.environ:  # a user's own setting wins
        assert "zmm" in dot.inspect_asm(dot.signatures[0])


def run_python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")}
    done = subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True, text=True,
                          check=True)
    return done.stdout.strip()


def test_idle_thread_pools_spin_briefly_unless_the_user_says_otherwise():
    show = "import os, inferno; print(os.environ['GOMP_SPINCOUNT'], os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    assert run_python(show) == "30000 16"
    assert run_python(show, GOMP_SPINCOUNT="5", OPENBLAS_THREAD_TIMEOUT="20") == "5 20"
