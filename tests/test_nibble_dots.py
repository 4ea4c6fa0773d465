"""The integer dots of the 4-bit types: activations split into int8 parts that rebuild them to
float32's precision, and nibble sums equal to numpy's integer arithmetic (rounded once to float32)
on the CPU's byte dot product and on the plain-IR path other CPUs take."""

from __future__ import annotations

import numpy as np
import pytest

from inferno import nibble_dots
from inferno.jit import njit
from inferno.nibble_dots import LANES, PART_BITS, PARTS, has_vnni, nibble_sums, split_activations


def activations(rng: np.random.Generator) -> np.ndarray:
    """Blocks of 32 that stress the split: normal values, a zero block, one outlier among tiny
    values, negative extremes, huge and tiny magnitudes, and subnormals."""
    x = rng.standard_normal((8, 32)).astype(np.float32)
    x[1] = 0
    x[2] = 1e-6 * x[2]
    x[2, 5] = 300.0
    x[3] = -np.abs(x[3])
    x[4] *= np.float32(1e30)
    x[5] *= np.float32(2.0**-90)
    x[6] *= np.float32(1e-40)
    return x.reshape(-1)


def split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = x.size // 32
    parts = np.empty((PARTS, x.size), np.int8)
    scale, sums = np.empty(blocks, np.float32), np.empty(blocks, np.float32)
    split_activations(x, parts, scale, sums)
    return parts, scale, sums


def test_split_rebuilds_each_value_to_float32_precision():
    """What is left: float32's rounding of the value itself, plus 2^-28 of its block's largest."""
    x = activations(np.random.default_rng(0))
    parts, scale, sums = split(x)
    combined = sum(parts[i].astype(np.int64) << (PART_BITS * (PARTS - 1 - i)) for i in range(PARTS))
    rebuilt = np.repeat(scale.astype(np.float64), 32) * combined
    top = np.repeat(np.abs(x.reshape(-1, 32)).max(axis=1).astype(np.float64), 32)
    kept = top >= 2.0**-100
    bound = np.abs(x) * 2.0**-23 + top * 2.0**-28
    assert np.all(np.abs(rebuilt - x)[kept] <= bound[kept])
    assert np.all(np.abs(parts[0]) <= 127)
    assert np.all(np.abs(parts[1:]) <= 1 << (PART_BITS - 1))  # remainders stay inside half a step
    assert not parts[:, 32:64].any() and scale[1] == 0  # a zero block is zero parts
    assert not parts[:, 192:224].any() and scale[6] == 0  # so is a block under 2^-100
    np.testing.assert_allclose(sums, x.reshape(-1, 32).astype(np.float64).sum(axis=1), rtol=1e-6, atol=0)


def nibble_reference(quads: np.ndarray, parts: np.ndarray) -> np.ndarray:
    """(S0 * 2^7 + S1) * 2^14 + S2 * 2^7 + S3 for 16 rows of one block, rounded once to float32;
    quads uint8[4, 16 rows, 4 bytes]."""
    q = np.empty((LANES, 32), np.int64)
    for k in range(4):
        q[:, 4 * k : 4 * k + 4] = quads[k] & 15
        q[:, 16 + 4 * k : 20 + 4 * k] = quads[k] >> 4
    s = q @ parts[:, :32].T.astype(np.int64)  # [rows, part]
    return (sum(s[:, i] << PART_BITS * (PARTS - 1 - i) for i in range(PARTS))).astype(np.float32)


def compile_sums():
    """A fresh (uncached) caller, so the intrinsic is generated again under the current has_vnni."""
    @njit(cache=False)
    def sums_of(w, parts, out):
        nibble_sums(w, 0, 4 * LANES, parts, 0, out, 0)

    return sums_of


@pytest.mark.parametrize("vnni", [True, False], ids=["vpdpbusd", "plain-ir"])
def test_nibble_sums_are_exact_integers(monkeypatch, vnni):
    if vnni and not has_vnni():
        pytest.skip("this CPU has no AVX512-VNNI")
    monkeypatch.setattr(nibble_dots, "has_vnni", lambda: vnni)
    rng = np.random.default_rng(1)
    quads = rng.integers(0, 256, (4, LANES, 4), dtype=np.uint8)
    quads[0, 0] = 255  # the largest nibbles against the largest parts: the sum's extreme
    x = activations(rng)[:32]
    parts, _, _ = split(x)
    parts[:, :4] = -127
    out = np.zeros(LANES, np.float32)
    sums_of = compile_sums()
    sums_of(quads, parts, out)
    assert np.array_equal(out, nibble_reference(quads, parts))
    asm = sums_of.inspect_asm(sums_of.signatures[0])
    assert ("vpdpbusd" in asm) == vnni
