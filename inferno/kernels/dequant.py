"""Exact dequantization of one tile (inferno.kernels.quant's Layout): the same float32 operations, in
the same order, as gguf-py's, so a weight read back is bit-identical to `gguf.quants.dequantize`.
Used for embedding rows, for BLAS on dequantized chunks (long prompts) and by the types without fused
dots. Also the scalar helpers every kernel on tiles reads blocks with (`f16`)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from inferno.kernels.ggml import BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0
from inferno.kernels.jit import njit
from inferno.kernels.llvm_ir import float_from_bits, shift_right
from inferno.kernels.nibble_dots import PACKED

# ---------------------------------------------------------------------------------------------------
# Scalar helpers. `w` is one tile: uint8[block, byte, lane].


@intrinsic
def _halffloat_from_bits(typingctx, bits):
    """IEEE half -> float32 with the CPU's conversion instruction. Exact for every finite value and inf;
    only a signalling NaN's payload may differ from numpy (it comes back quieted)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@njit(cache=True)
def _u16(w, b, p, r):
    return np.uint16(w[b, p, r] | (np.uint32(w[b, p + 1, r]) << 8))


@njit(cache=True)
def f16(w, b, p, r):
    """The little-endian half at bytes p, p+1 of block b, lane r."""
    return _halffloat_from_bits(_u16(w, b, p, r))


@njit(cache=True)
def zero(a):
    # an explicit loop: slice assignment (a[:] = 0) makes Numba compile extra helpers, slowing cold start
    for i in range(a.size):
        a[i] = 0


# ---------------------------------------------------------------------------------------------------
# Exact dequantization of lanes [r0, r1) of one tile, transposed: out[col, at + lane - r0]. Lanes are
# the innermost loop so whole tiles vectorize. Same float32 operations, in the same order, as
# gguf/quants.py.


@njit(cache=True)
def _deq_f32(w, r0, r1, out, at):
    for c in range(w.shape[0]):
        for r in range(r0, r1):
            bits = np.uint32(_u16(w, c, 0, r)) | (np.uint32(_u16(w, c, 2, r)) << 16)
            out[c, at + r - r0] = float_from_bits(bits)


@njit(cache=True)
def _deq_f16(w, r0, r1, out, at):
    for c in range(w.shape[0]):
        for r in range(r0, r1):
            out[c, at + r - r0] = f16(w, c, 0, r)


@njit(cache=True)
def _deq_bf16(w, r0, r1, out, at):
    for c in range(w.shape[0]):
        for r in range(r0, r1):
            out[c, at + r - r0] = float_from_bits(np.uint32(_u16(w, c, 0, r)) << 16)


@njit(cache=True)
def _deq_q8_0(w, r0, r1, out, at):
    for b in range(w.shape[0]):
        for j in range(32):
            for r in range(r0, r1):
                out[32 * b + j, at + r - r0] = np.float32(np.int8(w[b, 2 + j, r])) * f16(w, b, 0, r)


@njit(cache=True)
def _halves(low, high, out):
    """out[c] = the f16 whose bytes are low[c], high[c]."""
    for c in range(out.size):
        out[c] = _halffloat_from_bits(np.uint16(low[c] | (np.uint32(high[c]) << 8)))


@njit(cache=True)
def _deq_packed(w, r0, r1, out, at, qtype, per, quads, stride, high_bits, planes):
    """The packed types (inferno.nibble_dots.PACKED; its fields after qtype), from their tiles. The words
    of a quad or plane row of all lanes are contiguous (lane q * n + c's at row + q, column c, n = lanes
    / 4), so one value of every lane is one vectorized loop over consecutive words. It indexes slices
    from 0: indexed with r0 + c, which might be negative (Numba wraps those around), LLVM gathered the
    words one at a time and the BLAS path's dequantization took 1.6-2x as long."""
    words = w.view(np.uint32)
    n = words.shape[2]
    flat = words.reshape(w.shape[0], w.shape[1] * n)
    d, m = np.empty(r1 - r0, np.float32), np.empty(r1 - r0, np.float32)  # the f16s at bytes 0 and 2
    for b in range(w.shape[0]):
        _halves(w[b, 0, r0:r1], w[b, 1, r0:r1], d)
        _halves(w[b, 2, r0:r1], w[b, 3, r0:r1], m)
        for j in range(per):
            scales, mins = w[b, 4 + j, r0:r1], w[b, 12 + j, r0:r1]
            for half in range(2):
                signed = w[b, 2 + 2 * j + half, r0:r1]
                row = (planes + stride * j + (4 * half if high_bits == 2 else 0)) * n
                plane = flat[b, row + r0 : row + r1]
                for k in range(4):
                    row = (quads + stride * j + 4 * k) * n
                    quad = flat[b, row + r0 : row + r1]
                    for i in range(4):
                        dst = out[32 * (per * b + j) + 16 * half + 4 * k + i, at : at + r1 - r0]
                        low = np.uint32(8 * i + 4 * half)
                        high = np.uint32(8 * i + k + 4 * half if high_bits == 1 else 8 * i + 2 * k)
                        for c in range(r1 - r0):
                            v = np.uint32(shift_right(quad[c], low) & np.uint32(15))
                            if high_bits:
                                bits = np.uint32(shift_right(plane[c], high) & np.uint32(high_bits * 2 - 1))
                                v = np.uint32(v | np.uint32(bits << np.uint32(4)))
                            # v - offset in float is exact, and stays 32-bit (Numba's int32 - int32 is 64)
                            if qtype == Q4_0:
                                dst[c] = d[c] * (np.float32(v) - np.float32(8))
                            elif qtype in (Q4_1, Q5_1):
                                dst[c] = d[c] * np.float32(v) + m[c]
                            elif qtype == Q5_0:
                                dst[c] = d[c] * (np.float32(v) - np.float32(16))
                            elif qtype in (Q4_K, Q5_K):
                                dl, ml = d[c] * np.float32(scales[c]), m[c] * np.float32(mins[c])
                                dst[c] = dl * np.float32(v) - ml
                            else:
                                dl = d[c] * np.float32(np.int8(signed[c]))
                                dst[c] = dl * (np.float32(v) - np.float32(32))


def _packed_dequantizer(qtype: int):
    """_deq_packed for one packed type, its Packing's fields closure constants (cached as module
    functions are)."""
    per, quads, stride, high_bits, planes = PACKED[qtype]

    @njit(cache=True)
    def dequantize(w, r0, r1, out, at):
        _deq_packed(w, r0, r1, out, at, qtype, per, quads, stride, high_bits, planes)

    return dequantize


DEQUANTIZE = {F32: _deq_f32, F16: _deq_f16, BF16: _deq_bf16, Q8_0: _deq_q8_0} | {
    qtype: _packed_dequantizer(qtype) for qtype in PACKED}


def dequantize_tile(qtype, w, r0, r1, out, at=0):
    """Dequantize lanes [r0, r1) of tile w into out[col, at + lane - r0] (dispatch stub, see the
    overload). `at` places a tile among others' columns: W.T written in place, rows of out contiguous."""
    raise NotImplementedError


@overload(dequantize_tile, prefer_literal=True)
def _dequantize_tile_impl(qtype, w, r0, r1, out, at=0):
    deq = DEQUANTIZE[qtype.literal_value]
    return lambda qtype, w, r0, r1, out, at=0: deq(w, r0, r1, out, at)
