"""The hand-written LLVM IR of our intrinsics, its small builders gathered in one place: vector
constants, a typed pointer into an array, a scalar splatted across a vector, an LLVM intrinsic
function declared once per module; and the intrinsics the streaming kernels use (float_from_bits;
prefetch_row for the weights, prefetch_ahead for the cache's rows; word_at for the repacking). The
integer dots of inferno.kernels.nibble_dots and the cache's block dots (inferno.kv.vectors) build their
IR from these."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_INT = ir.IntType(32)


def constant(element: ir.Type, values: list[int] | list[float]) -> ir.Constant:
    """A vector constant of `element`s."""
    return ir.Constant(ir.VectorType(element, len(values)), values)


def pointer(context, builder, array_type, array, offset, element: ir.Type) -> ir.Value:
    """Address of the array's flat element `offset` as a pointer to `element` (any alignment)."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), element.as_pointer())


def splat(builder, value: ir.Value, lanes: int) -> ir.Value:
    """`value` in every one of `lanes` lanes."""
    vector = ir.VectorType(value.type, lanes)
    first = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(_INT, 0))
    return builder.shuffle_vector(first, first, constant(_INT, [0] * lanes))


def declared(module: ir.Module, name: str, function_type: ir.FunctionType) -> ir.Function:
    """The function `name` of the module (an LLVM intrinsic such as llvm.prefetch.p0), declared on
    first use."""
    return module.globals.get(name) or ir.Function(module, function_type, name)


def halves_to_floats(builder, low: ir.Value, high: ir.Value) -> ir.Value:
    """The f16s whose low and high bytes are the <n x i8> `low` and `high`, as <n x float>."""
    n = low.type.count
    short = ir.VectorType(ir.IntType(16), n)
    high_byte = builder.shl(builder.zext(high, short), ir.Constant(short, [8] * n))
    bits = builder.or_(builder.zext(low, short), high_byte)
    halves = builder.bitcast(bits, ir.VectorType(ir.HalfType(), n))
    return builder.fpext(halves, ir.VectorType(ir.FloatType(), n))


def prefetch_line(builder, at: ir.Value, locality: int = 3) -> None:
    """Ask for the cache line holding the byte at `at` (an i8 pointer) into the CPU's caches
    (llvm.prefetch, read): with locality 3 into every level, with 2 into L2 and beyond (x86's
    prefetcht1). A prefetch never faults, so the byte may lie past an array's end."""
    byte_pointer, int32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fetch = declared(builder.module, "llvm.prefetch.p0",
                     ir.FunctionType(ir.VoidType(), [byte_pointer, int32, int32, int32]))
    builder.call(fetch, [at, ir.Constant(int32, 0), ir.Constant(int32, locality), ir.Constant(int32, 1)])


def prefetch_bytes(builder, start: ir.Value, nbytes: ir.Value, locality: int = 3) -> None:
    """prefetch_line for each cache line of bytes start..start+nbytes (an i8 pointer and a count)."""
    zero, line = ir.Constant(nbytes.type, 0), ir.Constant(nbytes.type, 64)
    with cgutils.for_range_slice(builder, zero, nbytes, line) as (offset, _):
        prefetch_line(builder, builder.gep(start, [offset]), locality)


# How far ahead of what they read the loops over the cache's rows ask for memory (prefetch_ahead): of
# 0.5, 1, 2, 3 and 6 KiB, 2 KiB decoded fastest on all four models (docs/LOG.md, 2026-11-26); a
# non-temporal hint was 2x slower. The weights ask a span ahead instead (prefetch_row).
PREFETCH_AHEAD = 2048


@intrinsic
def float_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the uint32 `bits`."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def shift_right(typingctx, word, bits):
    """The uint32 `word` shifted right by `bits` (under 32), in 32 bits. Numba's >> widens both to 64
    bits, and LLVM cannot narrow a shift by a count it does not know: vectorized, the loop then runs half
    as many lanes an instruction and converts 64-bit integers to float."""
    if word != types.uint32 or bits != types.uint32:
        return None
    sig = types.uint32(types.uint32, types.uint32)

    def codegen(context, builder, signature, args):
        return builder.lshr(args[0], args[1])

    return sig, codegen


@intrinsic
def word_at(typingctx, data, at):
    """The little-endian uint32 at byte `at` of the uint8 array `data`, wherever it starts (one
    unaligned load: assembled from four bytes, the repacking loop over a block's words vectorized into
    scatters)."""
    if not (isinstance(data, types.Array) and data.dtype == types.uint8 and isinstance(at, types.Integer)):
        return None
    sig = types.uint32(data, at)

    def codegen(context, builder, signature, args):
        offset = context.cast(builder, args[1], signature.args[1], types.intp)
        word = pointer(context, builder, signature.args[0], args[0], offset, _INT)
        return builder.load(word, align=1)

    return sig, codegen


def _row_signature(array, i):
    """The signature of a row prefetch (array, i), or None for arguments it does not take."""
    if not isinstance(array, types.Array) or array.layout != "C" or not isinstance(i, types.Integer):
        return None
    return types.void(array, i)


def _row(context, builder, signature, args) -> tuple[ir.Value, ir.Value]:
    """array[i]'s first byte (an i8 pointer) and its size in bytes, for a row prefetch's (array, i)."""
    struct = context.make_array(signature.args[0])(context, builder, args[0])
    step = cgutils.unpack_tuple(builder, struct.strides)[0]
    row = builder.mul(context.cast(builder, args[1], signature.args[1], types.intp), step)
    return builder.gep(builder.bitcast(struct.data, ir.IntType(8).as_pointer()), [row]), step


@intrinsic
def prefetch_ahead(typingctx, array, i):
    """Ask for as many bytes as array[i] holds, PREFETCH_AHEAD bytes past array[i]'s start, into every
    level of the CPU's caches (llvm.prefetch: read, locality 3), a cache line at a time. A loop over
    the cache's rows calls it once per row i it is about to read: with only the CPU's own prefetching,
    the rows streamed from memory at about half the speed. The addresses
    may lie past the array's end: a prefetch never faults. (Written in IR, not as a jitted loop: that
    added half a second of compiling to every kernel calling it.)"""

    def codegen(context, builder, signature, args):
        first, step = _row(context, builder, signature, args)
        prefetch_bytes(builder, builder.gep(first, [ir.Constant(step.type, PREFETCH_AHEAD)]), step)
        return context.get_dummy_value()

    sig = _row_signature(array, i)
    return None if sig is None else (sig, codegen)


@intrinsic
def prefetch_row(typingctx, array, i):
    """Ask for the bytes of array[i] into L2 (llvm.prefetch, locality 2); i may lie past the array's
    end (a prefetch never faults). The weight kernels call it with i a span of blocks (SPAN) past the
    block they read, the distance the integer dots' own span prefetch has."""

    def codegen(context, builder, signature, args):
        first, step = _row(context, builder, signature, args)
        prefetch_bytes(builder, first, step, locality=2)
        return context.get_dummy_value()

    sig = _row_signature(array, i)
    return None if sig is None else (sig, codegen)
