"""Activations split into int8 parts for the integer dot products (inferno.kernels.nibble_dots).

Each block of 32 values of x is written as s * (a0 + a1/2^7 + a2/2^14 + a3/2^21),
with int8 parts a_i and s = max|x| / 127 (`split_activations`): x / s * 2^21 is rounded to an integer
once, whose balanced base-2^7 digits are a3, a2, a1 (each in -64..63) and a0 what is left (-127..127).
What is left is s / 2^22 = max|x| * 2^-29 per value at most, plus the float32 rounding of x / s
itself (2^-24 of each value): float32's own precision. Three parts
(max|x| * 2^-22) were not enough: a block with one large value and many small ones left the small
ones a relative error near 1e-3, and logits moved by 2e-4 against the float path. A block whose
largest value is under 2^-90 (far from anything a layer's activations hold; its scale would lose
bits) splits into zeros: its dot with the nibbles counts as 0, off by less than 2^-85 times the
block's largest weight.

Each block is split in whole-block vector code (two intrinsics): written as loops over its 32 values,
LLVM unrolled them and kept them scalar, each value's rounding, digits and stores one by one, and the
block's maximum and sum as chains of 32 dependent instructions.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from inferno.kernels.ggml import Q6_K, Q8_0
from inferno.kernels.jit import njit  # first: the target is set before any kernel is defined
from inferno.kernels.llvm_ir import constant, declared, pointer, splat

PARTS = 4  # int8 parts per activation: float32's precision, the default
# What a matvec may do to its activations, by name: how many int8 parts each value is split into.
# "int8" is one part per value, a float32 scale per block of 32: what llama.cpp's q8_0/q8_1
# activations hold (its scale is an f16), a quarter of the multiplies, with a rounding error that
# `kv-bench --fidelity --activations` measures.
ACTIVATIONS = {"f32": PARTS, "int8": 1}
PART_BITS = 7  # each part after the first weighs 2^-7 of the one before
TINY = np.float32(2.0**-90)  # blocks whose largest value is smaller split into zeros (see the docstring)
_INT = ir.IntType(32)


@njit(cache=True)
def sums_size(qtype, blocks):
    """How many sums of x a type's dots take (see integer_activations)."""
    return 2 * blocks if qtype == Q6_K else blocks


@njit(cache=True)
def integer_activations(x, parts, scale, sums, qtype):
    """x float32[cols] split for the integer dots of `qtype`: parts and each block's scale
    (split_activations), and sums float32[sums_size]: each block's sum of x, or for Q8_0 of part 0
    (its dots take back 128 times it), or for Q6_K of every 16 values (its offset of 32)."""
    split_activations(x, parts, scale, sums[: scale.size])
    if qtype == Q8_0:
        first_part_sums(parts, sums)
    elif qtype == Q6_K:
        half_sums(x, sums)


@njit(cache=True)
def half_sums(x, out):
    """out[h] = the sum of values 16h..16h+15 of x (what Q6_K's offset of 32 multiplies: its scales
    change every 16 values)."""
    for b in range(out.size // 2):
        _, low, high = _block_stats(x, 32 * b)
        out[2 * b], out[2 * b + 1] = low, high


@njit(cache=True, fastmath=True)
def split_activations(x, parts, scale, sums):
    """x float32[cols] (whole blocks of 32, C-contiguous) -> parts int8[n, cols] (n = 1..PARTS), scale
    float32[blocks] (s / 2^(7 (n - 1)), what multiplies a block's combined sum) and sums float32[blocks]
    (each block's sum of x, which Q4_1's minimum and Q4_0's offset of 8 multiply)."""
    n = parts.shape[0]
    bits = PART_BITS * (n - 1)
    for b in range(x.size // 32):
        top, low, high = _block_stats(x, 32 * b)
        sums[b] = low + high
        s = top / np.float32(127)
        inverse = np.float32(1) / s if top >= TINY else np.float32(0)
        scale[b] = s / np.float32(1 << bits)
        # round(x / s * 2^bits) once, then peel balanced base-2^7 digits off in integers: the same sum
        # as rounding part after part in float. The digits' count is a constant of each call.
        times = inverse * np.float32(1 << bits)
        if n == PARTS:
            _block_digits(x, 32 * b, times, parts, PARTS)
        elif n == 1:
            _block_digits(x, 32 * b, times, parts, 1)
        elif n == 2:
            _block_digits(x, 32 * b, times, parts, 2)
        elif n == 3:
            _block_digits(x, 32 * b, times, parts, 3)
        else:
            raise ValueError("activations split into 1 to 4 parts")


def _block_vector(context, builder, x_type, x, at: ir.Value) -> ir.Value:
    """The 32 floats of x from flat element `at` (an intp), as <32 x float>."""
    return builder.load(pointer(context, builder, x_type, x, at, ir.VectorType(ir.FloatType(), 32)), align=4)


def _tree(builder, vector: ir.Value, combine) -> ir.Value:
    """`vector`'s lanes combined pairwise, halves first (lanes i and i + n/2), down to one value."""
    while vector.type.count > 1:
        half = vector.type.count // 2
        low = builder.shuffle_vector(vector, vector, constant(_INT, list(range(half))))
        high = builder.shuffle_vector(vector, vector, constant(_INT, list(range(half, 2 * half))))
        vector = combine(low, high)
    return builder.extract_element(vector, ir.Constant(_INT, 0))


@intrinsic
def _block_stats(typingctx, x, first):
    """(max |value|, sum of values 0-15, sum of values 16-31) of the block of 32 values of x (float32,
    C-contiguous) starting at `first`, each summed in the same tree order on every CPU."""
    if not (isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C"
            and isinstance(first, types.Integer)):
        return None
    sig = types.UniTuple(types.float32, 3)(x, first)

    def codegen(context, builder, signature, args):
        at = context.cast(builder, args[1], signature.args[1], types.intp)
        block = _block_vector(context, builder, signature.args[0], args[0], at)
        vector = block.type
        fabs = declared(builder.module, "llvm.fabs.v32f32", ir.FunctionType(vector, [vector]))
        top = _tree(builder, builder.call(fabs, [block]), lambda a, b: builder.select(
            builder.fcmp_ordered(">", b, a), b, a))
        halves = [builder.shuffle_vector(block, block, constant(_INT, list(range(16 * h, 16 * h + 16))))
                  for h in range(2)]
        sums = [_tree(builder, half, builder.fadd) for half in halves]
        return context.make_tuple(builder, signature.return_type, [top, *sums])

    return sig, codegen


@intrinsic
def _block_digits(typingctx, x, first, times, parts, count):
    """parts[:count, first + j] = the balanced base-2^7 digits of round(x[first + j] * times) for the
    block's 32 values j, the last part the lowest digit (-64..63), part 0 what is left; count a
    compile-time constant, x and parts (int8[n, cols]) C-contiguous."""
    if not (isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C"
            and isinstance(parts, types.Array) and parts.dtype == types.int8 and parts.ndim == 2
            and parts.layout == "C" and isinstance(first, types.Integer) and times == types.float32
            and isinstance(count, types.IntegerLiteral)):
        return None
    sig = types.void(x, first, times, parts, count)
    n_digits = count.literal_value

    def codegen(context, builder, signature, args):
        x_t, first_t, _, parts_t, _ = signature.args
        at = context.cast(builder, args[1], first_t, types.intp)
        block = _block_vector(context, builder, x_t, args[0], at)
        vector, ints = block.type, ir.VectorType(_INT, 32)
        rint = declared(builder.module, "llvm.rint.v32f32", ir.FunctionType(vector, [vector]))
        fixed = builder.fptosi(builder.call(rint, [builder.fmul(block, splat(builder, args[2], 32))]), ints)
        struct = context.make_array(parts_t)(context, builder, args[3])
        cols = cgutils.unpack_tuple(builder, struct.shape)[1]

        def store(part: int, digits: ir.Value) -> None:
            flat = builder.add(builder.mul(cols, ir.Constant(cols.type, part)), at)
            target = pointer(context, builder, parts_t, args[3], flat, ir.VectorType(ir.IntType(8), 32))
            builder.store(builder.trunc(digits, target.type.pointee), target, align=1)

        half = constant(_INT, [1 << (PART_BITS - 1)] * 32)
        for part in range(n_digits - 1, 0, -1):
            shifted = builder.add(fixed, half)  # = 2^7 * rest + (digit + 64), digit + 64 in 0..127
            store(part, builder.sub(builder.and_(shifted, constant(_INT, [(1 << PART_BITS) - 1] * 32)), half))
            fixed = builder.ashr(shifted, constant(_INT, [PART_BITS] * 32))
        store(0, fixed)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def first_part_sums(parts, out):
    """out[b] = the sum of block b's values of part 0 (what Q8_0's integer dots take back)."""
    for b in range(out.size):
        total = 0
        for j in range(32):
            total += np.int32(parts[0, 32 * b + j])
        out[b] = np.float32(total)
