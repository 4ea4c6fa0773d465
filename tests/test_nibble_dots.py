"""The integer dots of the 4-bit types: activations split into int8 parts that rebuild them to
float32's precision, and nibble sums equal to numpy's integer arithmetic (rounded once to float32)
on the CPU's byte dot product and on the plain-IR path other CPUs take."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from inferno.kernels import nibble_dots as module
from inferno.kernels.activation_parts import (
    ACTIVATIONS,
    PART_BITS,
    PARTS,
    first_part_sums,
    integer_activations,
    split_activations,
    sums_size,
)
from inferno.kernels.jit import njit
from inferno.kernels.nibble_dots import LANES, PACKED, has_vnni, quant_dots
from inferno.kernels.repack import TILE_BYTES, repack


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


def split(x: np.ndarray, n_parts: int = PARTS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = x.size // 32
    parts = np.empty((n_parts, x.size), np.int8)
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
    kept = top >= 2.0**-90
    bound = np.abs(x) * 2.0**-23 + top * 2.0**-28
    assert np.all(np.abs(rebuilt - x)[kept] <= bound[kept])
    assert np.all(np.abs(parts[0]) <= 127)
    assert np.all(np.abs(parts[1:]) <= 1 << (PART_BITS - 1))  # remainders stay inside half a step
    assert not parts[:, 32:64].any() and scale[1] == 0  # a zero block is zero parts
    assert not parts[:, 192:224].any() and scale[6] == 0  # so is a block under 2^-90
    blocks = x.reshape(-1, 32).astype(np.float64)
    # a float32 sum of 32 values in a tree of depth 5: each level's rounding at most 2^-24 of sum |x|
    bound = 5 * 2.0**-24 * np.abs(blocks).sum(axis=1) + 2.0**-149
    assert np.all(np.abs(sums - blocks.sum(axis=1)) <= bound)


@pytest.mark.parametrize("n_parts", [1, 2, 3])
def test_fewer_parts_round_each_value_once(n_parts):
    """With n parts a value is round(x / s * 2^(7 (n - 1))) in balanced digits: off by at most half a
    step of the last part (plus float32's rounding of x / s), each digit inside its range."""
    x = activations(np.random.default_rng(1))
    parts, scale, _ = split(x, n_parts)
    bits = PART_BITS * (n_parts - 1)
    combined = sum(parts[i].astype(np.int64) << (PART_BITS * (n_parts - 1 - i)) for i in range(n_parts))
    rebuilt = np.repeat(scale.astype(np.float64), 32) * combined
    top = np.repeat(np.abs(x.reshape(-1, 32)).max(axis=1).astype(np.float64), 32)
    kept = top >= 2.0**-90
    bound = top / 127 * 2.0 ** -(bits + 1) * (1 + 2.0**-20) + np.abs(x) * 2.0**-22
    assert np.all(np.abs(rebuilt - x)[kept] <= bound[kept])
    assert np.all(np.abs(parts[0]) <= 127)
    assert np.all(np.abs(parts[1:]) <= 1 << (PART_BITS - 1))


def test_more_parts_than_four_are_refused():
    with pytest.raises(ValueError, match="1 to 4 parts"):
        split(np.ones(32, np.float32), 5)


def nibble_reference(quads: np.ndarray, parts: np.ndarray) -> np.ndarray:
    """[activation rows, 16 weight rows] of one block: sum_p S_p * 2^(7 (n - 1 - p)) over the n
    parts, rounded once to float32; quads uint8[4, 16 rows, 4 bytes], parts int8[rows, n, 32+]."""
    q = np.empty((LANES, 32), np.int64)
    for k in range(4):
        q[:, 4 * k : 4 * k + 4] = quads[k] & 15
        q[:, 16 + 4 * k : 20 + 4 * k] = quads[k] >> 4
    n = parts.shape[1]
    s = np.einsum("lv,rpv->rlp", q, parts[:, :, :32].astype(np.int64))  # [rows, lanes, part]
    return sum(s[:, :, i] << PART_BITS * (n - 1 - i) for i in range(n)).astype(np.float32)


def compile_dots(qtype: int, n_parts: int):
    """A fresh (uncached) caller, so the intrinsic is generated again under the current has_vnni."""
    @njit(cache=False)
    def dots(w, parts, scale, sums, acc):
        quant_dots(w, 0, 0, parts, scale, sums, acc, qtype, n_parts, 1)  # block 0, lanes 0..15

    return dots


def q4_1_tile(quads: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """One block of 16 Q4_1 rows as a tile: uint8[1 block, 20 bytes, 16 lanes], d and m halves first."""
    w = np.empty((1, 20, LANES), np.uint8)
    w[0, 0:2] = d.astype(np.float16).view(np.uint8).reshape(LANES, 2).T
    w[0, 2:4] = m.astype(np.float16).view(np.uint8).reshape(LANES, 2).T
    w[0, 4:] = quads.reshape(-1).reshape(16, LANES)  # quads [4, lane, 4] laid flat, as tiles hold them
    return w


@pytest.mark.parametrize("n_parts", sorted(set(ACTIVATIONS.values())))
@pytest.mark.parametrize("vnni", [True, False], ids=["vpdpbusd", "plain-ir"])
def test_nibble_dots_are_exact_integer_sums_scaled_per_row(monkeypatch, vnni, n_parts):
    """Three activation rows against one block of 16 weight rows, every part count a mode uses: with
    d = 1, m = 0 and unit scales the sums come out exactly; with real ones, to float32 rounding."""
    if vnni and not has_vnni():
        pytest.skip("this CPU has no AVX512-VNNI")
    monkeypatch.setattr(module, "has_vnni", lambda: vnni)
    rng = np.random.default_rng(1)
    quads = rng.integers(0, 256, (4, LANES, 4), dtype=np.uint8)
    quads[0, 0] = 255  # the largest nibbles against the largest parts: the sum's extreme
    x = activations(rng)
    parts = np.stack([split(x[32 * r : 32 * r + 32], n_parts)[0] for r in (0, 3, 4)])
    parts[0, :, :4] = -127
    dots = compile_dots(int(Q.Q4_1), n_parts)
    acc = np.zeros((3, LANES), np.float32)
    dots(q4_1_tile(quads, np.ones(LANES), np.zeros(LANES)), parts, np.ones((3, 1), np.float32),
         np.zeros((3, 1), np.float32), acc)
    exact = nibble_reference(quads, parts)
    assert np.array_equal(acc, exact)
    d, m = rng.uniform(-0.1, 0.1, LANES), rng.uniform(-1, 1, LANES)
    scale = rng.uniform(0, 1e-4, (3, 1)).astype(np.float32)
    sums = rng.standard_normal((3, 1)).astype(np.float32)
    acc = np.ones((3, LANES), np.float32)
    dots(q4_1_tile(quads, d, m), parts, scale, sums, acc)
    d, m = d.astype(np.float16).astype(np.float64), m.astype(np.float16).astype(np.float64)
    want = 1 + d * scale * exact.astype(np.float64) + m * sums
    np.testing.assert_allclose(acc, want, rtol=1e-6, atol=1e-6)
    asm = dots.inspect_asm(dots.signatures[0])
    assert ("vpdpbusd" in asm) == vnni


@pytest.mark.parametrize("vnni", [True, False], ids=["vpdpbusd", "plain-ir"])
def test_q8_0_dots_with_one_part_are_exact(monkeypatch, vnni):
    """Q8_0 bytes (signed, the whole range) against one int8 part: with d = 1 and a unit scale, acc
    gets exactly sum(byte * part) for 16 rows and two activation rows."""
    if vnni and not has_vnni():
        pytest.skip("this CPU has no AVX512-VNNI")
    monkeypatch.setattr(module, "has_vnni", lambda: vnni)
    rng = np.random.default_rng(3)
    q = rng.integers(-128, 128, (LANES, 32), dtype=np.int8)
    q[0] = -128  # the most negative bytes against the largest parts
    w = np.empty((1, 34, LANES), np.uint8)
    w[0, 0:2] = np.ones(LANES, np.float16).view(np.uint8).reshape(LANES, 2).T
    w[0, 2:] = q.view(np.uint8).T  # value j of every row side by side, as Q8_0 tiles hold them
    x = activations(rng)
    parts = np.stack([split(x[32 * r : 32 * r + 32], 1)[0] for r in (0, 3)])
    parts[0, 0, :] = -127
    sums = np.empty((2, 1), np.float32)
    for i in range(2):
        first_part_sums(parts[i], sums[i])
    acc = np.zeros((2, LANES), np.float32)
    compile_dots(int(Q.Q8_0), 1)(w, parts, np.ones((2, 1), np.float32), sums, acc)
    want = parts[:, 0, :32].astype(np.int64) @ q.T.astype(np.int64)  # [activation rows, weight rows]
    assert np.array_equal(acc, want.astype(np.float32))


def test_one_part_is_int8_rounding():
    """The int8 mode: each value rounded to the nearest step of its block's max / 127."""
    x = activations(np.random.default_rng(2))[64:128]  # an outlier block and an all-negative one
    parts, scale, _ = split(x, ACTIVATIONS["int8"])
    step = np.abs(x.reshape(2, 32)).max(axis=1) / 127
    assert np.array_equal(scale, step.astype(np.float32))
    np.testing.assert_array_equal(parts[0], np.round(x / np.repeat(step, 32)).astype(np.int8))


def packed_tile(qtype: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """One repacked tile of 64 rows of random blocks (every bit pattern of values, high bits, scales
    and minimums), their f16 scales finite: uint8[blocks, tile bytes, 64 lanes]."""
    block, type_size = gguf.GGML_QUANT_SIZES[Q(qtype)]
    raw = rng.integers(0, 256, (64, cols // block, type_size), dtype=np.uint8)
    for offset in (208,) if qtype == Q.Q6_K else (0, 2):  # d, and m or dmin (Q4_0, Q5_0: two qs bytes)
        scale = rng.uniform(1e-4, 2e-2, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
        raw[..., offset : offset + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    tiles = np.empty((1, cols // block, TILE_BYTES.get(qtype, type_size), 64), np.uint8)
    repack(raw, tiles, qtype)
    return tiles[0]


def compile_tile_dots(qtype: int, n_parts: int, span: int = 1):
    """A fresh caller of every block (`span` at a time) and group of 16 lanes of a tile (see
    compile_dots)."""
    @njit(cache=False)
    def dots(w, parts, scale, sums, acc):
        for b in range(0, scale.shape[1], span):
            for g in range(0, acc.shape[1], LANES):
                quant_dots(w, b, g, parts, scale, sums, acc, qtype, n_parts, span)

    return dots


def split_rows(qtype: int, x: np.ndarray, n_parts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x's rows split for the integer dots of qtype: parts, scales and sums as the kernels take them."""
    rows, cols = x.shape
    parts = np.empty((rows, n_parts, cols), np.int8)
    scale, sums = np.empty((rows, cols // 32), np.float32), np.empty((rows, cols // 16), np.float32)
    for i in range(rows):
        integer_activations(x[i], parts[i], scale[i], sums[i, : sums_size(qtype, cols // 32)], qtype)
    return parts, scale, np.ascontiguousarray(sums[:, : sums_size(qtype, cols // 32)])


@pytest.mark.parametrize("n_parts", sorted(set(ACTIVATIONS.values())))
@pytest.mark.parametrize("qtype", sorted(PACKED), ids=lambda t: Q(t).name)
def test_a_span_adds_the_bits_of_its_blocks(qtype, n_parts):
    """Decode's call, one row and SPAN blocks (its lanes' sums kept in a register, a K-quant's d and
    dmin converted once, the next span's bytes prefetched), gives the bits of one call per block."""
    rng = np.random.default_rng(qtype + 100 * n_parts)
    cols = 2 * module.SPAN * 32  # two spans
    tile = packed_tile(qtype, cols, rng)
    x = rng.standard_normal((1, cols)).astype(np.float32)  # no block so large that it hides the rest
    parts, scale, sums = split_rows(qtype, x, n_parts)
    one, span = np.zeros((1, 64), np.float32), np.zeros((1, 64), np.float32)
    compile_tile_dots(qtype, n_parts)(tile, parts, scale, sums, one)
    compile_tile_dots(qtype, n_parts, module.SPAN)(tile, parts, scale, sums, span)
    assert np.isfinite(one).all() and np.all(one != 0)
    assert np.array_equal(one.view(np.uint32), span.view(np.uint32))


@pytest.mark.parametrize("n_parts", sorted(set(ACTIVATIONS.values())))
@pytest.mark.parametrize("qtype", sorted(PACKED), ids=lambda t: Q(t).name)
def test_both_instruction_paths_give_the_same_bits(monkeypatch, qtype, n_parts):
    """Each packed type's dots (its repacked nibbles, high-bit planes, scales and minimums) on vpdpbusd
    and in plain IR: the same integer sums, scaled by the same float operations, so the same bits."""
    if not has_vnni():
        pytest.skip("this CPU has no AVX512-VNNI")
    rng = np.random.default_rng(qtype + 10 * n_parts)
    cols = 512
    tile = packed_tile(qtype, cols, rng)
    x = np.stack([np.concatenate([activations(rng), activations(rng)]) for _ in range(3)])
    parts = np.empty((3, n_parts, cols), np.int8)
    scale, sums = np.empty((3, cols // 32), np.float32), np.empty((3, cols // 16), np.float32)
    for i in range(3):
        integer_activations(x[i], parts[i], scale[i], sums[i, : sums_size(qtype, cols // 32)], qtype)
    sums = np.ascontiguousarray(sums[:, : sums_size(qtype, cols // 32)])
    results = []
    for vnni in (True, False):
        monkeypatch.setattr(module, "has_vnni", lambda vnni=vnni: vnni)
        dots = compile_tile_dots(qtype, n_parts)
        acc = np.zeros((3, 64), np.float32)
        dots(tile, parts, scale, sums, acc)
        assert ("vpdpbusd" in dots.inspect_asm(dots.signatures[0])) == vnni
        results.append(acc)
    assert np.isfinite(results[0]).all() and np.all(results[0] != 0)
    assert np.array_equal(results[0].view(np.uint32), results[1].view(np.uint32))
