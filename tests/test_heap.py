"""Once a model is loaded, a forward's large temporaries reuse the heap's pages instead of faulting in
fresh ones each time (runtime.engine.reuse_freed_pages)."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

LAYER = """
import resource, sys
import numpy as np
if sys.argv[1] == "reuse":
    from inferno.runtime.engine import reuse_freed_pages
    reuse_freed_pages()

def layer():  # a layer's temporaries, as a 1.5B model's 512-token prefill makes them (MiB)
    gate, up = np.ones(18 << 18, np.float32), np.ones(18 << 18, np.float32)
    gated = gate * up
    del gate, up
    scores = np.ones(12 << 18, np.float32)
    del scores
    wide = np.ones(48 << 18, np.float32)
    del gated, wide

layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
layer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults_of_a_second_layer(setting: str) -> int:
    done = subprocess.run([sys.executable, "-c", LAYER, setting], capture_output=True, text=True, check=True)
    return int(done.stdout)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="a C library without mallopt")
def test_a_layers_freed_temporaries_leave_their_pages_for_the_next_layer():
    fresh = page_faults_of_a_second_layer("default")
    assert fresh > 1000  # glibc's own thresholds: the large ones mapped afresh each time
    assert page_faults_of_a_second_layer("reuse") < fresh // 10
