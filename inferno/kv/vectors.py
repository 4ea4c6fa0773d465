"""One block of 32 stored cache values as an LLVM vector: the inner loops of attention on stored rows.

Written as LLVM IR because Numba's loops over 32 values do not vectorize: LLVM unrolls a 32-step
loop before its vectorizer runs, and the unrolled code converts each int8 or nibble to float on its
own (the float scratch it writes might alias the bytes it reads). Here a block is one vector load,
one widening conversion and one multiply on <32 x float> (two zmm registers), whatever the element
type, so q8_0 and q4_0 rows cost the float work of f32 rows while reading a quarter or an eighth
of the bytes.

Each function takes a stored row (a 1-D uint8 array) and the byte offset of the block's values in
it (after the scale), and float32 arrays indexed flat (C-contiguous). `kind` says how the block is
stored: KIND_F16 (32 IEEE halves), KIND_Q8 (32 int8), KIND_Q4 (16 bytes: low nibbles are values
0..15, high nibbles 16..31, each minus 8). A block is converted once for all the query heads of its
KV head (grouped-query attention: 3 heads share each KV head in SmolLM2), which made q8_0 attention
1.16x and the 4-bit kinds 1.44x faster than a conversion per head.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from inferno.llvm_ir import constant, pointer, splat

KIND_F16, KIND_Q8, KIND_Q4 = 0, 1, 2
LANES = 32
_BYTE, _INT = ir.IntType(8), ir.IntType(32)
_VEC = ir.VectorType(ir.FloatType(), LANES)


def _load_values(context, builder, kind: int, row_type, row, offset) -> ir.Value:
    """The block's 32 values as <32 x float>, before its scale."""
    def load(element: ir.Type, lanes: int) -> ir.Value:
        vector = ir.VectorType(element, lanes)
        return builder.load(pointer(context, builder, row_type, row, offset, vector), align=1)

    if kind == KIND_F16:
        return builder.fpext(load(ir.HalfType(), LANES), _VEC)
    if kind == KIND_Q8:
        return builder.sitofp(load(_BYTE, LANES), _VEC)
    packed = load(_BYTE, LANES // 2)
    low = builder.and_(packed, constant(_BYTE, [15] * (LANES // 2)))
    high = builder.lshr(packed, constant(_BYTE, [4] * (LANES // 2)))
    nibbles = builder.shuffle_vector(low, high, constant(_INT, list(range(LANES))))
    return builder.sitofp(builder.sub(nibbles, constant(_BYTE, [8] * LANES)), _VEC)


def _sum(builder, vector: ir.Value) -> ir.Value:
    """Sum of a vector's lanes, halving it by shuffles (LLVM lowers each step to one vector add)."""
    lanes = vector.type.count
    while lanes > 1:
        lanes //= 2
        lower = builder.shuffle_vector(vector, vector, constant(_INT, list(range(lanes))))
        upper = builder.shuffle_vector(vector, vector, constant(_INT, list(range(lanes, 2 * lanes))))
        vector = builder.fadd(lower, upper)
    return builder.extract_element(vector, ir.Constant(_INT, 0))


def _load_any(context, builder, kind: ir.Value, row_type, row, offset) -> ir.Value:
    """_load_values for a kind known only at run time: a branch per kind (KIND_Q4 the default one),
    the loaded vectors joined."""
    blocks = {kind_: builder.append_basic_block(f"kind{kind_}") for kind_ in (KIND_F16, KIND_Q8, KIND_Q4)}
    done = builder.append_basic_block("loaded")
    branches = builder.switch(kind, blocks[KIND_Q4])
    for literal in (KIND_F16, KIND_Q8):
        branches.add_case(ir.Constant(kind.type, literal), blocks[literal])
    values = []
    for literal, block in blocks.items():
        builder.position_at_end(block)
        values.append((_load_values(context, builder, literal, row_type, row, offset), builder.block))
        builder.branch(done)
    builder.position_at_end(done)
    joined = builder.phi(_VEC)
    for value, block in values:
        joined.add_incoming(value, block)
    return joined


def _c_arrays(*arrays) -> bool:
    """Whether every array is C-contiguous: the grouped functions index them flat."""
    return all(isinstance(a, types.Array) and a.layout == "C" for a in arrays)


@intrinsic
def block_dots(typingctx, kind, floats, at, stride, n, row, offset, out, out_at, out_stride, scale):
    """out[out_at + i * out_stride] += scale * sum_j floats[at + i * stride + j] * value_j for i < n:
    one block converted once for the n query heads of a KV head (grouped-query attention)."""
    if not isinstance(kind, types.Integer) or not _c_arrays(floats, out):
        return None
    sig = types.void(kind, floats, at, stride, n, row, offset, out, out_at, out_stride, scale)

    def codegen(context, builder, signature, args):
        kind_v, floats_v, at_v, stride_v, n_v, row_v, offset_v, out_v, out_at_v, out_stride_v, scale_v = args
        floats_t, row_t, out_t = signature.args[1], signature.args[5], signature.args[7]
        values = _load_any(context, builder, kind_v, row_t, row_v, offset_v)
        with cgutils.for_range(builder, n_v) as loop:
            i = loop.index
            start = builder.add(at_v, builder.mul(i, stride_v))
            head = pointer(context, builder, floats_t, floats_v, start, _VEC)
            total = _sum(builder, builder.fmul(builder.load(head, align=4), values))
            cell = builder.add(out_at_v, builder.mul(i, out_stride_v))
            target = pointer(context, builder, out_t, out_v, cell, ir.FloatType())
            builder.store(builder.fadd(builder.load(target), builder.fmul(scale_v, total)), target)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def block_axpys(typingctx, kind, floats, at, stride, n, coefs, c_at, c_stride, scale, row, offset):
    """floats[at + i * stride + j] += scale * coefs[c_at + i * c_stride] * value_j for i < n: one block
    converted once and added into the outputs of the n query heads of a KV head."""
    if not isinstance(kind, types.Integer) or not _c_arrays(floats, coefs):
        return None
    sig = types.void(kind, floats, at, stride, n, coefs, c_at, c_stride, scale, row, offset)

    def codegen(context, builder, signature, args):
        kind_v, floats_v, at_v, stride_v, n_v, coefs_v, c_at_v, c_stride_v, scale_v, row_v, offset_v = args
        floats_t, coefs_t, row_t = signature.args[1], signature.args[5], signature.args[9]
        values = _load_any(context, builder, kind_v, row_t, row_v, offset_v)
        with cgutils.for_range(builder, n_v) as loop:
            i = loop.index
            cell = builder.add(c_at_v, builder.mul(i, c_stride_v))
            coef = builder.load(pointer(context, builder, coefs_t, coefs_v, cell, ir.FloatType()))
            start = builder.add(at_v, builder.mul(i, stride_v))
            head = pointer(context, builder, floats_t, floats_v, start, _VEC)
            added = builder.fmul(splat(builder, builder.fmul(scale_v, coef), LANES), values)
            builder.store(builder.fadd(builder.load(head, align=4), added), head, align=4)
        return context.get_dummy_value()

    return sig, codegen
