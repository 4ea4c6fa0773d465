"""One block of 32 stored cache values as an LLVM vector: the inner loops of attention on stored rows.

Written as LLVM IR because Numba's loops over 32 values do not vectorize: LLVM unrolls a 32-step
loop before its vectorizer runs, and the unrolled code converts each int8 or nibble to float on its
own (the float scratch it writes might alias the bytes it reads). Here a block is one vector load,
one widening conversion and one multiply on <32 x float> (two zmm registers), whatever the element
type, so q8_0 and q4_0 rows cost the float work of f32 rows while reading a quarter or an eighth
of the bytes.

Each function takes a stored row (a 1-D uint8 array) and the byte offset of the block's values in
it (after the scale), and a float32 array with the offset of its 32 matching floats. `kind` is a
literal: KIND_F16 (32 IEEE halves), KIND_Q8 (32 int8), KIND_Q4 (16 bytes: low nibbles are values
0..15, high nibbles 16..31, each minus 8).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

KIND_F16, KIND_Q8, KIND_Q4 = 0, 1, 2
LANES = 32
_BYTE, _INT = ir.IntType(8), ir.IntType(32)
_VEC = ir.VectorType(ir.FloatType(), LANES)


def _constant(element: ir.Type, values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(element, len(values)), values)


def _pointer(context, builder, array_type, array, offset, element: ir.Type) -> ir.Value:
    """Address of array[offset] as a pointer to `element` (any alignment)."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), element.as_pointer())


def _load_values(context, builder, kind: int, row_type, row, offset) -> ir.Value:
    """The block's 32 values as <32 x float>, before its scale."""
    def load(element: ir.Type, lanes: int) -> ir.Value:
        vector = ir.VectorType(element, lanes)
        return builder.load(_pointer(context, builder, row_type, row, offset, vector), align=1)

    if kind == KIND_F16:
        return builder.fpext(load(ir.HalfType(), LANES), _VEC)
    if kind == KIND_Q8:
        return builder.sitofp(load(_BYTE, LANES), _VEC)
    packed = load(_BYTE, LANES // 2)
    low = builder.and_(packed, _constant(_BYTE, [15] * (LANES // 2)))
    high = builder.lshr(packed, _constant(_BYTE, [4] * (LANES // 2)))
    nibbles = builder.shuffle_vector(low, high, _constant(_INT, list(range(LANES))))
    return builder.sitofp(builder.sub(nibbles, _constant(_BYTE, [8] * LANES)), _VEC)


def _sum(builder, vector: ir.Value) -> ir.Value:
    """Sum of a vector's lanes, halving it by shuffles (LLVM lowers each step to one vector add)."""
    lanes = vector.type.count
    while lanes > 1:
        lanes //= 2
        lower = builder.shuffle_vector(vector, vector, _constant(_INT, list(range(lanes))))
        upper = builder.shuffle_vector(vector, vector, _constant(_INT, list(range(lanes, 2 * lanes))))
        vector = builder.fadd(lower, upper)
    return builder.extract_element(vector, ir.Constant(_INT, 0))


@intrinsic
def block_dot(typingctx, kind, floats, at, row, offset):
    """sum_j floats[at + j] * value_j over the block's 32 values (its scale not applied)."""
    if not isinstance(kind, types.IntegerLiteral):
        return None  # Numba asks again with the literal
    sig = types.float32(kind, floats, at, row, offset)

    def codegen(context, builder, signature, args):
        _, floats_value, at_value, row_value, at_row = args
        values = _load_values(context, builder, kind.literal_value, signature.args[3], row_value, at_row)
        where = _pointer(context, builder, signature.args[1], floats_value, at_value, _VEC)
        return _sum(builder, builder.fmul(builder.load(where, align=4), values))

    return sig, codegen


@intrinsic
def block_axpy(typingctx, kind, floats, at, coef, row, offset):
    """floats[at + j] += coef * value_j over the block's 32 values (coef carries the scale)."""
    if not isinstance(kind, types.IntegerLiteral):
        return None
    sig = types.void(kind, floats, at, coef, row, offset)

    def codegen(context, builder, signature, args):
        _, floats_value, at_value, coef_value, row_value, at_row = args
        values = _load_values(context, builder, kind.literal_value, signature.args[4], row_value, at_row)
        where = _pointer(context, builder, signature.args[1], floats_value, at_value, _VEC)
        first = builder.insert_element(ir.Constant(_VEC, ir.Undefined), coef_value, ir.Constant(_INT, 0))
        coefs = builder.shuffle_vector(first, first, _constant(_INT, [0] * LANES))
        builder.store(builder.fadd(builder.load(where, align=4), builder.fmul(coefs, values)), where, align=4)
        return context.get_dummy_value()

    return sig, codegen
