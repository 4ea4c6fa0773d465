"""Exact dequantization of one tile (inferno.kernels.quant's Layout): the same float32 operations, in
the same order, as gguf-py's, so a weight read back is bit-identical to `gguf.quants.dequantize`.
Used for embedding rows, for BLAS on dequantized chunks (long prompts) and by the types without fused
dots. Also the scalar helpers every kernel on tiles reads blocks with (`f16`)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from inferno.kernels.ggml import BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from inferno.kernels.jit import njit
from inferno.kernels.llvm_ir import float_from_bits
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
# Exact dequantization of lanes [r0, r1) of one tile, transposed: out[col, lane - r0]. Lanes are the
# innermost loop so whole tiles vectorize. Same float32 operations, in the same order, as gguf/quants.py.


@njit(cache=True)
def _deq_f32(w, r0, r1, out):
    for c in range(w.shape[0]):
        for r in range(r0, r1):
            bits = np.uint32(_u16(w, c, 0, r)) | (np.uint32(_u16(w, c, 2, r)) << 16)
            out[c, r - r0] = float_from_bits(bits)


@njit(cache=True)
def _deq_f16(w, r0, r1, out):
    for c in range(w.shape[0]):
        for r in range(r0, r1):
            out[c, r - r0] = f16(w, c, 0, r)


@njit(cache=True)
def _deq_bf16(w, r0, r1, out):
    for c in range(w.shape[0]):
        for r in range(r0, r1):
            out[c, r - r0] = float_from_bits(np.uint32(_u16(w, c, 0, r)) << 16)


@njit(cache=True)
def _deq_q8_0(w, r0, r1, out):
    for b in range(w.shape[0]):
        for j in range(32):
            for r in range(r0, r1):
                out[32 * b + j, r - r0] = np.float32(np.int8(w[b, 2 + j, r])) * f16(w, b, 0, r)


@njit(cache=True)
def _packed_value(words, b, quads, planes, high_bits, k, q, c, i, half):
    """Value 16 half + 4k + i of lane q * n + c of the sub-block whose quads start at byte row `quads`
    and planes at `planes` (inferno.nibble_dots.Packing): the 32-bit word [b, row + q, c] holds word
    row // 4 of lane q * n + c, n = lanes / 4."""
    v = (words[b, quads + 4 * k + q, c] >> np.uint32(8 * i + 4 * half)) & np.uint32(15)
    if high_bits == 1:
        v |= ((words[b, planes + q, c] >> np.uint32(8 * i + k + 4 * half)) & np.uint32(1)) << np.uint32(4)
    elif high_bits == 2:
        v |= ((words[b, planes + 4 * half + q, c] >> np.uint32(8 * i + 2 * k)) & np.uint32(3)) << np.uint32(4)
    return np.int32(v)


@njit(cache=True)
def _deq_packed(w, r0, r1, out, qtype, per, quads, stride, high_bits, planes):
    """The packed types (inferno.nibble_dots.PACKED; its fields after qtype), from their tiles."""
    words = w.view(np.uint32)
    n = words.shape[2]
    for b in range(w.shape[0]):
        for j in range(per):
            for k in range(4):
                for q in range(4):
                    for c in range(max(0, r0 - q * n), min(n, r1 - q * n)):
                        r = q * n + c
                        d = f16(w, b, 0, r)
                        for half in range(2):
                            e = 32 * (per * b + j) + 16 * half + 4 * k
                            if qtype in (Q4_K, Q5_K):
                                dl = d * np.float32(w[b, 4 + j, r])
                                ml = f16(w, b, 2, r) * np.float32(w[b, 12 + j, r])
                            elif qtype == Q6_K:
                                dl = d * np.float32(np.int8(w[b, 2 + 2 * j + half, r]))
                            for i in range(4):
                                v = _packed_value(words, b, quads + stride * j, planes + stride * j,
                                                  high_bits, k, q, c, i, half)
                                if qtype == Q4_0:
                                    out[e + i, r - r0] = d * np.float32(v - 8)
                                elif qtype in (Q4_1, Q5_1):
                                    out[e + i, r - r0] = d * np.float32(v) + f16(w, b, 2, r)
                                elif qtype == Q5_0:
                                    out[e + i, r - r0] = d * np.float32(v - 16)
                                elif qtype in (Q4_K, Q5_K):
                                    out[e + i, r - r0] = dl * np.float32(v) - ml
                                else:
                                    out[e + i, r - r0] = dl * np.float32(v - 32)


def _packed_dequantizer(qtype: int):
    """_deq_packed for one packed type, its Packing's fields closure constants (cached as module
    functions are)."""
    per, quads, stride, high_bits, planes = PACKED[qtype]

    @njit(cache=True)
    def dequantize(w, r0, r1, out):
        _deq_packed(w, r0, r1, out, qtype, per, quads, stride, high_bits, planes)

    return dequantize


DEQUANTIZE = {F32: _deq_f32, F16: _deq_f16, BF16: _deq_bf16, Q8_0: _deq_q8_0} | {
    qtype: _packed_dequantizer(qtype) for qtype in PACKED}


def dequantize_tile(qtype, w, r0, r1, out):
    """Dequantize lanes [r0, r1) of tile w into out[col, lane - r0] (dispatch stub, see the overload)."""
    raise NotImplementedError


@overload(dequantize_tile, prefer_literal=True)
def _dequantize_tile_impl(qtype, w, r0, r1, out):
    deq = DEQUANTIZE[qtype.literal_value]
    return lambda qtype, w, r0, r1, out: deq(w, r0, r1, out)
