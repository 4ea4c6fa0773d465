"""One block of 32 stored cache values as an LLVM vector: the inner loops of attention on stored rows.

Written as LLVM IR because Numba's loops over 32 values do not vectorize: LLVM unrolls a 32-step
loop before its vectorizer runs, and the unrolled code converts each int8 or nibble to float on its
own (the float scratch it writes might alias the bytes it reads). Here a block is one vector load,
one widening conversion and one multiply on <32 x float> (two zmm registers), whatever the element
type, so q8_0 and q4_0 rows cost the float work of f32 rows while reading a quarter or an eighth
of the bytes.

Each function takes a stored row (a 1-D uint8 array) and the byte offset of the block's values in
it (after the scale), and float32 arrays indexed flat (C-contiguous). `packing` says how the block is
stored: PACK_F16 (32 IEEE halves), PACK_Q8 (32 int8), PACK_Q4 (16 bytes: low nibbles are values
0..15, high nibbles 16..31, each minus 8). A block is converted once for all the query heads of its
KV head (grouped-query attention: 3 heads share each KV head in SmolLM2), which made q8_0 attention
1.16x and the 4-bit kinds 1.44x faster than a conversion per head.

Summing a vector of products across its lanes costs more than the products. Where two blocks share
one scale (q4_recent's 64-value heads), the pair_ functions take both as one <64 x float>: one sum
per head instead of two made q4_recent's attention 1.12-1.16x faster.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from inferno.kernels.llvm_ir import constant, pointer, splat

PACK_F16, PACK_Q8, PACK_Q4 = 0, 1, 2
BLOCK_LANES = 32  # values of one block
_BYTE, _INT = ir.IntType(8), ir.IntType(32)


def _load_values(context, builder, packing: int, lanes: int, row_type, row, offset) -> ir.Value:
    """`lanes` values (one block of 32, or blocks stored back to back with no scale between) as
    <lanes x float>, before their scale."""
    def load(element: ir.Type, count: int) -> ir.Value:
        vector = ir.VectorType(element, count)
        return builder.load(pointer(context, builder, row_type, row, offset, vector), align=1)

    floats = ir.VectorType(ir.FloatType(), lanes)
    if packing == PACK_F16:
        return builder.fpext(load(ir.HalfType(), lanes), floats)
    if packing == PACK_Q8:
        return builder.sitofp(load(_BYTE, lanes), floats)
    packed = load(_BYTE, lanes // 2)
    low = builder.and_(packed, constant(_BYTE, [15] * (lanes // 2)))
    high = builder.lshr(packed, constant(_BYTE, [4] * (lanes // 2)))
    # each block's 16 bytes: its first 16 values in the low nibbles, its last 16 in the high ones
    order = [half * lanes // 2 + 16 * b + j for b in range(lanes // BLOCK_LANES) for half in (0, 1)
             for j in range(16)]
    nibbles = builder.shuffle_vector(low, high, constant(_INT, order))
    return builder.sitofp(builder.sub(nibbles, constant(_BYTE, [8] * lanes)), floats)


def _sum(builder, vector: ir.Value) -> ir.Value:
    """Sum of a vector's lanes, halving it by shuffles (LLVM lowers each step to one vector add)."""
    lanes = vector.type.count
    while lanes > 1:
        lanes //= 2
        lower = builder.shuffle_vector(vector, vector, constant(_INT, list(range(lanes))))
        upper = builder.shuffle_vector(vector, vector, constant(_INT, list(range(lanes, 2 * lanes))))
        vector = builder.fadd(lower, upper)
    return builder.extract_element(vector, ir.Constant(_INT, 0))


def _load_any(context, builder, packing: ir.Value, lanes: int, row_type, row, offset) -> ir.Value:
    """_load_values for a packing known only at run time: a branch per packing (PACK_Q4 the default one),
    the loaded vectors joined."""
    blocks = {p: builder.append_basic_block(f"packing{p}") for p in (PACK_F16, PACK_Q8, PACK_Q4)}
    done = builder.append_basic_block("loaded")
    branches = builder.switch(packing, blocks[PACK_Q4])
    for literal in (PACK_F16, PACK_Q8):
        branches.add_case(ir.Constant(packing.type, literal), blocks[literal])
    values = []
    for literal, block in blocks.items():
        builder.position_at_end(block)
        values.append((_load_values(context, builder, literal, lanes, row_type, row, offset), builder.block))
        builder.branch(done)
    builder.position_at_end(done)
    joined = builder.phi(ir.VectorType(ir.FloatType(), lanes))
    for value, block in values:
        joined.add_incoming(value, block)
    return joined


def _c_arrays(*arrays) -> bool:
    """Whether every array is C-contiguous: the grouped functions index them flat."""
    return all(isinstance(a, types.Array) and a.layout == "C" for a in arrays)


def _dots(lanes: int):
    @intrinsic
    def dots(typingctx, packing, floats, at, stride, n, row, offset, out, out_at, out_stride, scale):
        if not isinstance(packing, types.Integer) or not _c_arrays(floats, out):
            return None
        sig = types.void(packing, floats, at, stride, n, row, offset, out, out_at, out_stride, scale)

        def codegen(context, builder, signature, args):
            (kind_v, floats_v, at_v, stride_v, n_v, row_v, offset_v,
             out_v, out_at_v, out_stride_v, scale_v) = args
            floats_t, row_t, out_t = signature.args[1], signature.args[5], signature.args[7]
            values = _load_any(context, builder, kind_v, lanes, row_t, row_v, offset_v)
            with cgutils.for_range(builder, n_v) as loop:
                i = loop.index
                start = builder.add(at_v, builder.mul(i, stride_v))
                head = pointer(context, builder, floats_t, floats_v, start, values.type)
                total = _sum(builder, builder.fmul(builder.load(head, align=4), values))
                cell = builder.add(out_at_v, builder.mul(i, out_stride_v))
                target = pointer(context, builder, out_t, out_v, cell, ir.FloatType())
                builder.store(builder.fadd(builder.load(target), builder.fmul(scale_v, total)), target)
            return context.get_dummy_value()

        return sig, codegen

    dots.__doc__ = f"""out[out_at + i * out_stride] += scale * sum_j floats[at + i * stride + j] * value_j for
    i < n, over {lanes} stored values: converted once for the n query heads of a KV head (grouped-query
    attention), their products summed once per head."""
    return dots


def _axpys(lanes: int):
    @intrinsic
    def axpys(typingctx, packing, floats, at, stride, n, coefs, c_at, c_stride, scale, row, offset):
        if not isinstance(packing, types.Integer) or not _c_arrays(floats, coefs):
            return None
        sig = types.void(packing, floats, at, stride, n, coefs, c_at, c_stride, scale, row, offset)

        def codegen(context, builder, signature, args):
            (kind_v, floats_v, at_v, stride_v, n_v, coefs_v, c_at_v, c_stride_v,
             scale_v, row_v, offset_v) = args
            floats_t, coefs_t, row_t = signature.args[1], signature.args[5], signature.args[9]
            values = _load_any(context, builder, kind_v, lanes, row_t, row_v, offset_v)
            with cgutils.for_range(builder, n_v) as loop:
                i = loop.index
                cell = builder.add(c_at_v, builder.mul(i, c_stride_v))
                coef = builder.load(pointer(context, builder, coefs_t, coefs_v, cell, ir.FloatType()))
                start = builder.add(at_v, builder.mul(i, stride_v))
                head = pointer(context, builder, floats_t, floats_v, start, values.type)
                added = builder.fmul(splat(builder, builder.fmul(scale_v, coef), lanes), values)
                builder.store(builder.fadd(builder.load(head, align=4), added), head, align=4)
            return context.get_dummy_value()

        return sig, codegen

    axpys.__doc__ = f"""floats[at + i * stride + j] += scale * coefs[c_at + i * c_stride] * value_j for i < n,
    over {lanes} stored values: converted once and added into the outputs of the n query heads of a KV
    head."""
    return axpys


block_dots, block_axpys = _dots(BLOCK_LANES), _axpys(BLOCK_LANES)
# two blocks sharing one scale (q4_recent's 64-value heads): one sum of products per head, not two
pair_dots, pair_axpys = _dots(2 * BLOCK_LANES), _axpys(2 * BLOCK_LANES)
