"""A few activation rows against a quantized weight, reading the weight once for all of them: the
matrix product of batched decoding (B sequences, one token each).

One matvec per row reads every weight B times from memory; BLAS first dequantizes the whole weight to
float32. Here each thread takes a run of tiles (the layout of `inferno.kernels.quant`) and reads each weight
byte from memory once per step whatever B is: the packed types (nibble_dots.PACKED) through the
integer dots of the single-row kernel, one row after another while the tile is in cache (so every
row's result is bit-identical to its matvec); Q8_0 straight from the blocks four rows at a time; the
other types through a scratch in L1 holding a few dequantized blocks of one tile.

BLAS on dequantized chunks (`QuantizedMatrix.matmul`) does not pay below 16 rows: dequantizing the
whole weight costs more than the product saves (the measurements are in docs/LOG.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numba
import numpy as np
from numba import prange

from inferno.kernels.activation_parts import integer_activations, sums_size
from inferno.kernels.dequant import dequantize_tile, f16
from inferno.kernels.ggml import Q8_0
from inferno.kernels.jit import njit
from inferno.kernels.llvm_ir import prefetch_row
from inferno.kernels.nibble_dots import SPAN
from inferno.kernels.quant import QuantizedMatrix, _dot_integer, integer_parts

GROUP_VALUES = 32  # values of a row dequantized per step: one block of the 32-value types


def batch_matmul(matrix: QuantizedMatrix, x: np.ndarray) -> np.ndarray:
    """x @ W.T for a few rows x [B, cols] -> [B, rows]. One row is a plain matvec (decode's kernel);
    two or more share each read of the weight."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != matrix.cols:
        raise ValueError(f"{matrix.name}: batch_matmul needs x of shape (B, {matrix.cols}), got {x.shape}")
    if x.shape[0] == 1:
        return matrix.matmul(x)
    n_rows, qtype = x.shape[0], int(matrix.qtype)
    n_parts = integer_parts(qtype, matrix.activations)
    if qtype == Q8_0 and not n_parts and n_rows % 4:  # whole groups of four rows; zero rows pad
        x = np.concatenate([x, np.zeros((4 - n_rows % 4, x.shape[1]), np.float32)])
    out = np.empty((x.shape[0], matrix.rows), np.float32)
    _batch_kernel(qtype, n_parts)(matrix._tiles, x, out, numba.config.NUMBA_NUM_THREADS)
    return out[:n_rows]


@njit(cache=True, fastmath=True)
def _accumulate(x, deq, acc):
    """acc[lane] += x . deq[:, lane] for one row (the rows past the last group of four), eight values
    of x per pass over the lanes: eight multiply-adds per load and store of acc."""
    j = 0
    while j + 8 <= x.size:
        x0, x1, x2, x3 = x[j], x[j + 1], x[j + 2], x[j + 3]
        x4, x5, x6, x7 = x[j + 4], x[j + 5], x[j + 6], x[j + 7]
        d0, d1, d2, d3 = deq[j], deq[j + 1], deq[j + 2], deq[j + 3]
        d4, d5, d6, d7 = deq[j + 4], deq[j + 5], deq[j + 6], deq[j + 7]
        for r in range(acc.size):
            acc[r] += (x0 * d0[r] + x1 * d1[r] + x2 * d2[r] + x3 * d3[r]) + \
                (x4 * d4[r] + x5 * d5[r] + x6 * d6[r] + x7 * d7[r])
        j += 8
    for k in range(j, x.size):  # a float matrix's last few values
        for r in range(acc.size):
            acc[r] += x[k] * deq[k, r]


@njit(cache=True, fastmath=True)
def _accumulate_four(x, i, k0, deq, acc):
    """acc[i + n, lane] += x[i + n, k0:] . deq[:, lane] for the four rows n = 0..3: each dequantized
    value is loaded once for four rows (register blocking). Written out because LLVM vectorizes the
    lane loop only with the rows unrolled by hand and one array each for x, deq and acc (a loop over
    the rows, or a view per row, leaves it scalar: 4x slower). deq's rows: a multiple of 8 (a float
    matrix's last few columns go row by row)."""
    for j in range(0, deq.shape[0], 8):
        k = k0 + j
        a0, a1, a2, a3 = x[i, k], x[i, k + 1], x[i, k + 2], x[i, k + 3]
        a4, a5, a6, a7 = x[i, k + 4], x[i, k + 5], x[i, k + 6], x[i, k + 7]
        b0, b1, b2, b3 = x[i + 1, k], x[i + 1, k + 1], x[i + 1, k + 2], x[i + 1, k + 3]
        b4, b5, b6, b7 = x[i + 1, k + 4], x[i + 1, k + 5], x[i + 1, k + 6], x[i + 1, k + 7]
        c0, c1, c2, c3 = x[i + 2, k], x[i + 2, k + 1], x[i + 2, k + 2], x[i + 2, k + 3]
        c4, c5, c6, c7 = x[i + 2, k + 4], x[i + 2, k + 5], x[i + 2, k + 6], x[i + 2, k + 7]
        f0, f1, f2, f3 = x[i + 3, k], x[i + 3, k + 1], x[i + 3, k + 2], x[i + 3, k + 3]
        f4, f5, f6, f7 = x[i + 3, k + 4], x[i + 3, k + 5], x[i + 3, k + 6], x[i + 3, k + 7]
        for r in range(acc.shape[1]):
            e0, e1, e2, e3 = deq[j, r], deq[j + 1, r], deq[j + 2, r], deq[j + 3, r]
            e4, e5, e6, e7 = deq[j + 4, r], deq[j + 5, r], deq[j + 6, r], deq[j + 7, r]
            acc[i, r] += (a0 * e0 + a1 * e1 + a2 * e2 + a3 * e3) + (a4 * e4 + a5 * e5 + a6 * e6 + a7 * e7)
            acc[i + 1, r] += (b0 * e0 + b1 * e1 + b2 * e2 + b3 * e3) + (b4 * e4 + b5 * e5 + b6 * e6 + b7 * e7)
            acc[i + 2, r] += (c0 * e0 + c1 * e1 + c2 * e2 + c3 * e3) + (c4 * e4 + c5 * e5 + c6 * e6 + c7 * e7)
            acc[i + 3, r] += (f0 * e0 + f1 * e1 + f2 * e2 + f3 * e3) + (f4 * e4 + f5 * e5 + f6 * e6 + f7 * e7)


# ---------------------------------------------------------------------------------------------------
# Q8_0 from the blocks, four rows at a time, no scratch. Each weight byte is widened to float once for
# four rows and eight values of each row are loaded into locals before the pass over the lanes, so
# that loop vectorizes with the row values broadcast (loaded inside it, they might alias acc and LLVM
# leaves the loop scalar). A block's sum is scaled once per lane, as the single-row kernels of
# inferno.kernels.quant do; reading the blocks directly beats dequantizing to a scratch (docs/LOG.md).


@njit(cache=True, fastmath=True)
def _four_rows_q8_0(w, x, i, acc):
    """acc[i + n, lane] += (row lane of tile w) . x[i + n] for n = 0..3: value j of a block is the
    int8 at byte 2 + j, times the block's d. Eight values per pass."""
    for b in range(w.shape[0]):
        prefetch_row(w, b + SPAN)  # as every weight stream asks: a span ahead, into L2
        for j in range(0, 32, 8):
            k = 32 * b + j
            a0, a1, a2, a3 = x[i, k], x[i, k + 1], x[i, k + 2], x[i, k + 3]
            a4, a5, a6, a7 = x[i, k + 4], x[i, k + 5], x[i, k + 6], x[i, k + 7]
            b0, b1, b2, b3 = x[i + 1, k], x[i + 1, k + 1], x[i + 1, k + 2], x[i + 1, k + 3]
            b4, b5, b6, b7 = x[i + 1, k + 4], x[i + 1, k + 5], x[i + 1, k + 6], x[i + 1, k + 7]
            c0, c1, c2, c3 = x[i + 2, k], x[i + 2, k + 1], x[i + 2, k + 2], x[i + 2, k + 3]
            c4, c5, c6, c7 = x[i + 2, k + 4], x[i + 2, k + 5], x[i + 2, k + 6], x[i + 2, k + 7]
            f0, f1, f2, f3 = x[i + 3, k], x[i + 3, k + 1], x[i + 3, k + 2], x[i + 3, k + 3]
            f4, f5, f6, f7 = x[i + 3, k + 4], x[i + 3, k + 5], x[i + 3, k + 6], x[i + 3, k + 7]
            p = 2 + j
            for r in range(acc.shape[1]):
                e0, e1 = np.float32(np.int8(w[b, p, r])), np.float32(np.int8(w[b, p + 1, r]))
                e2, e3 = np.float32(np.int8(w[b, p + 2, r])), np.float32(np.int8(w[b, p + 3, r]))
                e4, e5 = np.float32(np.int8(w[b, p + 4, r])), np.float32(np.int8(w[b, p + 5, r]))
                e6, e7 = np.float32(np.int8(w[b, p + 6, r])), np.float32(np.int8(w[b, p + 7, r]))
                d = f16(w, b, 0, r)
                acc[i, r] += d * ((a0 * e0 + a1 * e1 + a2 * e2 + a3 * e3)
                                  + (a4 * e4 + a5 * e5 + a6 * e6 + a7 * e7))
                acc[i + 1, r] += d * ((b0 * e0 + b1 * e1 + b2 * e2 + b3 * e3)
                                      + (b4 * e4 + b5 * e5 + b6 * e6 + b7 * e7))
                acc[i + 2, r] += d * ((c0 * e0 + c1 * e1 + c2 * e2 + c3 * e3)
                                      + (c4 * e4 + c5 * e5 + c6 * e6 + c7 * e7))
                acc[i + 3, r] += d * ((f0 * e0 + f1 * e1 + f2 * e2 + f3 * e3)
                                      + (f4 * e4 + f5 * e5 + f6 * e6 + f7 * e7))


@functools.cache
def _batch_kernel(qtype: int, n_parts: int) -> Callable:
    """The batched product of one type (n_parts: how many int8 parts x is split into, 0: float32)."""
    if n_parts:
        return _integer_kernel(qtype, n_parts)
    if qtype == Q8_0:
        return _q8_0_kernel()

    @njit(cache=True, parallel=True, fastmath=True)
    def matmul_rows(tiles, x, out, nchunks):
        ntiles, nblocks, _, lanes = tiles.shape
        n_rows, cols = x.shape
        per_block = cols // nblocks
        group = max(1, GROUP_VALUES // per_block)  # blocks dequantized together
        nchunks = min(ntiles, nchunks)
        for c in prange(nchunks):  # one run of tiles per thread: scratch allocated once per thread
            deq = np.empty((group * per_block, lanes), np.float32)
            acc = np.empty((n_rows, lanes), np.float32)
            for t in range(c * ntiles // nchunks, (c + 1) * ntiles // nchunks):
                acc[:] = 0.0
                for b0 in range(0, nblocks, group):
                    b1 = min(b0 + group, nblocks)
                    dequantize_tile(qtype, tiles[t, b0:b1], 0, lanes, deq)
                    k0, k1 = b0 * per_block, b1 * per_block
                    four = n_rows - n_rows % 4 if (k1 - k0) % 8 == 0 else 0
                    for i in range(0, four, 4):
                        _accumulate_four(x, i, k0, deq[: k1 - k0], acc)
                    for i in range(four, n_rows):
                        _accumulate(x[i, k0:k1], deq[: k1 - k0], acc[i])
                for i in range(n_rows):
                    for r in range(min(lanes, out.shape[1] - t * lanes)):
                        out[i, t * lanes + r] = acc[i, r]

    return matmul_rows


@functools.cache
def _q8_0_kernel() -> Callable:
    @njit(cache=True, parallel=True, fastmath=True)
    def matmul_rows(tiles, x, out, nchunks):
        """x [rows, a multiple of 4] through Q8_0 tiles' blocks."""
        ntiles, lanes, n_rows = tiles.shape[0], tiles.shape[3], x.shape[0]
        nchunks = min(ntiles, nchunks)
        for c in prange(nchunks):  # one run of tiles per thread
            acc = np.empty((n_rows, lanes), np.float32)
            for t in range(c * ntiles // nchunks, (c + 1) * ntiles // nchunks):
                acc[:] = 0.0
                for i in range(0, n_rows, 4):
                    _four_rows_q8_0(tiles[t], x, i, acc)
                for i in range(n_rows):
                    for r in range(min(lanes, out.shape[1] - t * lanes)):
                        out[i, t * lanes + r] = acc[i, r]

    return matmul_rows


@functools.cache
def _integer_kernel(qtype: int, n_parts: int) -> Callable:
    @njit(cache=True, parallel=True, fastmath=True)
    def matmul_rows(tiles, x, out, nchunks):
        """The packed types (or Q8_0 with one part): each row of x split into int8 parts once, then, tile
        by tile and block by block, the integer dots of inferno.kernels.quant for one row after another
        (the block stays in cache after the first row)."""
        ntiles, lanes = tiles.shape[0], tiles.shape[3]
        n_rows, cols = x.shape
        nblocks = cols // 32  # blocks of x's values (a K-quant block of the tiles holds eight)
        parts = np.empty((n_rows, n_parts, cols), np.int8)
        scale = np.empty((n_rows, nblocks), np.float32)
        xs = np.empty((n_rows, sums_size(qtype, nblocks)), np.float32)
        for i in prange(n_rows):  # a prompt's rows split on every thread
            integer_activations(x[i], parts[i], scale[i], xs[i], qtype)
        nchunks = min(ntiles, nchunks)
        for c in prange(nchunks):  # one run of tiles per thread
            acc = np.empty((n_rows, lanes), np.float32)
            for t in range(c * ntiles // nchunks, (c + 1) * ntiles // nchunks):
                acc[:] = 0.0
                _dot_integer(tiles[t], parts, scale, xs, acc, qtype, n_parts)
                for i in range(n_rows):
                    for r in range(min(lanes, out.shape[1] - t * lanes)):
                        out[i, t * lanes + r] = acc[i, r]

    return matmul_rows
