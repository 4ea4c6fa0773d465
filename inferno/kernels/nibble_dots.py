"""Dot products of 4-, 5- and 6-bit weights with float32 activations in integer arithmetic, exact to
float32's own rounding: the inner loop of the matrix-vector products of the packed types (PACKED; and
of Q8_0's when the activations are rounded to int8, `--activations int8`).

Why integers. In float, every nibble is widened and converted before its multiply-add; the CPU's byte
dot product (AVX512-VNNI's vpdpbusd: 64 unsigned bytes times 64 signed bytes, each group of four
products added into one of 16 int32 lanes) does the work of 64 of them in one instruction.

The activations come split into int8 parts a_i, a block's value s * (a0 + a1/2^7 + a2/2^14 +
a3/2^21) (inferno.kernels.activation_parts).

Per block and row, S_i = sum(q * a_i) over the 32 nibbles q are exact int32 sums (|S_i| <= 32 * 15
* 127 = 60,960), and so are S0 * 2^7 + S1 and S2 * 2^7 + S3 (under 2^23, exact in float32 too): the
block's dot is s / 2^21 times (S0 * 2^7 + S1) * 2^14 + (S2 * 2^7 + S3), rounded once. With 5-bit values
(q <= 31) they stay under 2^24, as do Q6_K's, summed 16 values at a time.

The weights. vpdpbusd takes four consecutive bytes of a row from one 32-bit lane, so tiles hold each
row's 16 nibble bytes as four 4-byte words: the quads of `inferno.kernels.quant`'s Layout. Byte i of quad k
holds values 4k + i (low nibble) and 16 + 4k + i (high nibble).

Q8_0 tiles keep each value's bytes side by side across lanes (its float path reads them so); the
integer dot shuffles four values' bytes into quads, and adds 128 to each (vpdpbusd's first operand is
unsigned), taking 128 times the part's block sum back afterwards. It is used with one part only: with
four, the integer path would cost as many multiplies as float32 and Q8_0 reads at memory speed
already.

CPUs without AVX512-VNNI get the same sums written as widening multiplies in plain LLVM IR, which
every target compiles (slower, same integers). Which one is built is decided from the CPU features
Numba compiles for, the same ones its kernel cache is keyed by.
"""

from __future__ import annotations

from typing import NamedTuple

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from inferno.kernels.activation_parts import ACTIVATIONS, PART_BITS
from inferno.kernels.ggml import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from inferno.kernels.jit import compiled_for  # first: the target is set before any kernel is defined
from inferno.kernels.llvm_ir import (
    constant,
    declared,
    halves_to_floats,
    pointer,
    prefetch_bytes,
    prefetch_line,
    splat,
)

LANES = 16  # rows summed per call: the int32 lanes of one 512-bit register
SPAN = 8  # blocks of 32 values per call for a single row: a K-quant block of the tiles
CHAINS = 4  # independent integer sums kept in flight per block (split among the parts)
_BYTE, _SHORT, _INT = ir.IntType(8), ir.IntType(16), ir.IntType(32)


def has_vnni() -> bool:
    """Whether the kernels are compiled for a CPU with AVX512-VNNI."""
    return compiled_for("+avx512vnni")


def _dot_bytes(builder, acc: ir.Value, unsigned: ir.Value, signed: ir.Value, vnni: bool) -> ir.Value:
    """acc <16 x i32> plus, in lane l, the sum of the four products of bytes 4l..4l+3 of `unsigned`
    and `signed` (<16 x i32> each holding 64 bytes): vpdpbusd, or the same in plain IR."""
    if vnni:
        vector = acc.type
        dot = declared(builder.module, "llvm.x86.avx512.vpdpbusd.512", ir.FunctionType(vector, [vector] * 3))
        return builder.call(dot, [acc, unsigned, signed])
    bytes64 = ir.VectorType(_BYTE, 4 * LANES)
    wide = ir.VectorType(_SHORT, 4 * LANES)
    products = builder.mul(builder.zext(builder.bitcast(unsigned, bytes64), wide),
                           builder.sext(builder.bitcast(signed, bytes64), wide))
    products = builder.sext(products, ir.VectorType(_INT, 4 * LANES))
    for i in range(4):
        byte_i = builder.shuffle_vector(products, products, constant(_INT, list(range(i, 4 * LANES, 4))))
        acc = builder.add(acc, byte_i)
    return acc


class Packing(NamedTuple):
    """Where a packed type's tiles hold what (byte rows of a block of the tile, inferno.quant's Layout).
    Each sub-block of 32 values keeps its low four bits as nibble quads: 16 bytes, byte i of quad k
    holding values 4k + i (low nibble) and 16 + 4k + i (high nibble), as four 4-byte words per row.
    Bits above the nibble lie in planes of the same shape: one 4-byte word per row, byte i of plane
    word p holding, for the 5-bit types (Q5_0, Q5_1, Q5_K), bit m of value 4m + i (m < 4) or
    16 + 4(m - 4) + i (m >= 4), and for Q6_K, bits 2k..2k+1 of value 4k + i (word 0) or 16 + 4k + i
    (word 1)."""

    sub_blocks: int  # blocks of 32 values per block of the tile
    quads: int  # byte row of the first sub-block's nibble quads
    stride: int  # byte rows from one sub-block's quads (and planes) to the next's
    high_bits: int  # bits of each value above its nibble
    planes: int  # byte row of the first sub-block's planes


# The types whose matvec takes integer dots of packed values. Q4_0 and Q4_1 keep the file's bytes,
# their nibbles reordered; the others are repacked at load (inferno.quant), to the file's size (Q5_0,
# Q5_1: d (and m), a plane word, the quads; Q6_K: d, then its 16 int8 scales at rows 2-17, then eight
# sub-blocks of quads and two plane words) or a little more (Q4_K: 148 bytes for 144, its 6-bit scales
# and minimums unpacked to a byte each at rows 4-11 and 12-19; Q5_K: 180 for 176, Q4_K's rows 0-19 then
# eight sub-blocks of quads and one plane word).
PACKED = {
    Q4_0: Packing(1, 2, 16, 0, 0),
    Q4_1: Packing(1, 4, 16, 0, 0),
    Q5_0: Packing(1, 6, 16, 1, 2),
    Q5_1: Packing(1, 8, 16, 1, 4),
    Q4_K: Packing(8, 20, 16, 0, 0),
    Q5_K: Packing(8, 20, 20, 1, 36),
    Q6_K: Packing(8, 18, 24, 2, 34),
}


@intrinsic
def quant_dots(typingctx, w, b, g, parts, scale, sums, acc, qtype, n_parts, span):
    """acc[i, g + l] += what weight row g + l of blocks b..b+span-1 of tile w (uint8[block, byte,
    lane]) adds to the product with every activation row i, for 16 rows l, from the integer dots of
    the blocks' weights with parts[i] (int8[rows, n_parts, cols]); qtype (the GGML type), n_parts and
    span are compile-time constants, all arrays C-contiguous. b counts blocks of 32 values (a K-quant
    block of the tile holds eight, see PACKED); a span of more than one block starts at a block of
    the tile (b a multiple of its sub-blocks) and, for K-quants, is its eight sub-blocks.

    The packed types (n_parts 1 or 4): d_l * scale[i, b] * D_il + m_l * sums[i, b], with D_il the
    combined dot, (S0 * 2^7 + S1) * 2^14 + S2 * 2^7 + S3 for four parts or S0 for one (S_p: value *
    part p over the block's 32 values), d_l and m_l the row's scale and minimum (Q4_0: m = -8 d;
    Q5_0: -16 d; Q4_1, Q5_1: the block's m; Q4_K, Q5_K: d * scale_j and -dmin * min_j of sub-block
    j) and sums[i, b] the block's sum of x_i. Q6_K's scales change every 16 values: it sums each half
    on its own, d_l * scale[i, b] * (sc_0 D_0 + sc_1 D_1) - 32 d_l (sc_0 sums[i, 2b] + sc_1 sums[i,
    2b + 1]), its sums per 16 values.
    Q8_0 (n_parts 1): d_l * scale[i, b] * (S'_il - 128 * sums[i, b]), with S' summing (byte + 128) *
    part 0, the unsigned operand vpdpbusd needs, and sums[i, b] the block's sum of part 0. Its tiles
    keep each value's bytes side by side across lanes; a shuffle makes the 4-byte quads.

    Each block's contribution is added to acc in block order, so every span gives the same bits. A
    span of one unpacks the block's weights once for all activation rows (a batch); a longer one is
    for a single row (decode), whose acc lanes stay in a register across the span and whose K-quant
    d and dmin are converted once, not once per sub-block."""
    arrays = (w, parts, scale, sums, acc)
    if not all(isinstance(a, types.Array) and a.layout == "C" for a in arrays):
        return None
    if (w.ndim, parts.ndim, scale.ndim, sums.ndim, acc.ndim) != (3, 3, 2, 2, 2):
        return None
    if not all(isinstance(v, types.IntegerLiteral) for v in (qtype, n_parts, span)):
        return None
    qtype_, count, span_ = qtype.literal_value, n_parts.literal_value, span.literal_value
    if not ((qtype_ in PACKED and count in ACTIVATIONS.values()) or (qtype_ == Q8_0 and count == 1)):
        return None
    per = PACKED[qtype_].sub_blocks if qtype_ in PACKED else 1
    if span_ < 1 or (per > 1 and span_ not in (1, per)):
        return None
    sig = types.void(w, b, g, parts, scale, sums, acc, qtype, n_parts, span)

    def codegen(context, builder, signature, args):
        vnni = has_vnni()
        w_v, b_v, g_v, parts_v, scale_v, sums_v, acc_v = args[:7]
        w_t, _, _, parts_t, scale_t, sums_t, acc_t = signature.args[:7]
        b_v = context.cast(builder, b_v, signature.args[1], types.intp)
        g_v = context.cast(builder, g_v, signature.args[2], types.intp)

        def shape(array_type, array) -> list[ir.Value]:
            struct = context.make_array(array_type)(context, builder, array)
            return cgutils.unpack_tuple(builder, struct.shape)

        _, type_size, lanes = shape(w_t, w_v)
        w_data = context.make_array(w_t)(context, builder, w_v).data
        rows, _, cols = shape(parts_t, parts_v)
        blocks = shape(scale_t, scale_v)[1]
        acc_width = shape(acc_t, acc_v)[1]
        ints, floats = ir.VectorType(_INT, LANES), ir.VectorType(ir.FloatType(), LANES)
        bytes16, bytes64 = ir.VectorType(_BYTE, LANES), ir.VectorType(_BYTE, 4 * LANES)

        def const(value: int) -> ir.Constant:
            return ir.Constant(lanes.type, value)

        packing = PACKED.get(qtype_, Packing(1, 2, 32, 0, 0))

        def byte_at(first: ir.Value, byte_row: int | ir.Value, offset: ir.Value) -> ir.Value:
            """The tile's byte of byte row `byte_row` of the stored block at byte `first`, `offset` in."""
            row = byte_row if isinstance(byte_row, ir.Value) else const(byte_row)
            return builder.add(first, builder.add(builder.mul(lanes, row), offset))

        def tile_bytes(first: ir.Value, byte_row: int | ir.Value, offset: ir.Value, vector: ir.Type
                       ) -> ir.Value:
            """The tile's bytes from byte_at(first, byte_row, offset) on, as `vector`."""
            at = byte_at(first, byte_row, offset)
            return builder.load(pointer(context, builder, w_t, w_v, at, vector), align=1)

        def next_group(first: ir.Value, byte_row: int | ir.Value, per_lane: int = 1) -> None:
            """A single row's next call reads lanes g+16..g+31 of the same byte rows: ask for their line
            of `byte_row` (per_lane bytes a lane) into L1 now. The span prefetch brings each span into
            L2 only, and a call's loads, rows a tile's width apart, then each waited on L2."""
            if span_ > 1:
                ahead = builder.mul(builder.add(g_v, const(LANES)), const(per_lane))
                prefetch_line(builder, builder.gep(w_data, [byte_at(first, byte_row, ahead)]), locality=3)

        def half_lanes(first: ir.Value, byte_row: int) -> ir.Value:
            """The f16 whose low byte is in row byte_row (high byte in the next), for lanes g..g+15."""
            next_group(first, byte_row)
            next_group(first, byte_row + 1)
            return halves_to_floats(builder, tile_bytes(first, byte_row, g_v, bytes16),
                                    tile_bytes(first, byte_row + 1, g_v, bytes16))

        def byte_lanes(first: ir.Value, byte_row: ir.Value, signed: bool = False) -> ir.Value:
            """The bytes of row byte_row for lanes g..g+15, as floats."""
            next_group(first, byte_row)
            convert = builder.sitofp if signed else builder.uitofp
            return convert(tile_bytes(first, byte_row, g_v, bytes16), floats)

        def stored_block(stored: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value | None]:
            """A stored block's first byte, its d and (K-quants) dmin for lanes g..g+15."""
            first = builder.mul(stored, builder.mul(type_size, lanes))
            dmin = half_lanes(first, 2) if qtype_ in (Q4_K, Q5_K) else None
            return first, half_lanes(first, 0), dmin

        def unpack(first: ir.Value, d: ir.Value, dmin: ir.Value | None, sub: ir.Value) -> tuple:
            """Sub-block `sub` of the stored block at `first`: its weights (16 rows' 4 unsigned bytes as
            <16 x i32>, with the first of the 4 values they hold), d, m and Q6_K's two half scales."""

            def words(byte_row: ir.Value) -> ir.Value:  # a quad or plane's words, lanes g..g+15
                next_group(first, byte_row, 4)
                return tile_bytes(first, byte_row, builder.mul(g_v, const(4)), bytes64)

            def row_of(first_row: int, offset: int = 0) -> ir.Value:  # rows advance by the stride
                return builder.add(const(first_row + offset), builder.mul(sub, const(packing.stride)))

            m = half_scales = None
            weights = []
            if qtype_ == Q8_0:
                offset = constant(_BYTE, [128] * 4 * LANES)
                for k in range(8):  # values 4k..4k+3, one byte row each, interleaved into quads
                    four = [tile_bytes(first, 2 + 4 * k + v, g_v, bytes16) for v in range(4)]
                    pairs = [builder.shuffle_vector(four[v], four[v + 1], constant(_INT, list(range(32))))
                             for v in (0, 2)]
                    joined = builder.shuffle_vector(pairs[0], pairs[1], constant(_INT, list(range(64))))
                    quad = builder.shuffle_vector(joined, joined, constant(
                        _INT, [16 * v + lane for lane in range(LANES) for v in range(4)]))
                    weights.append((builder.bitcast(builder.add(quad, offset), ints), 4 * k))
                return weights, d, m, half_scales
            if qtype_ in (Q4_K, Q5_K):
                m = builder.fneg(builder.fmul(dmin, byte_lanes(first, builder.add(const(12), sub))))
                d = builder.fmul(d, byte_lanes(first, builder.add(const(4), sub)))
            elif qtype_ == Q6_K:  # the two halves' int8 scales, at rows 2 + 2j and 3 + 2j
                half_scales = [byte_lanes(first, builder.add(const(2 + h), builder.mul(sub, const(2))), True)
                               for h in range(2)]
            elif qtype_ in (Q4_1, Q5_1):
                m = half_lanes(first, 2)
            else:  # Q4_0, Q5_0: q - 8, q - 16
                m = builder.fmul(d, ir.Constant(floats, [-8.0 if packing.high_bits == 0 else -16.0] * LANES))

            def byte_splat(value: int) -> ir.Constant:
                return constant(_BYTE, [value] * 4 * LANES)

            planes = [words(row_of(packing.planes, 4 * p)) for p in range(packing.high_bits)]
            for k in range(4):
                quad = words(row_of(packing.quads, 4 * k))
                nibbles = (builder.and_(quad, byte_splat(15)), builder.lshr(quad, byte_splat(4)))
                for half, value in enumerate(nibbles):
                    if packing.high_bits:  # 5-bit: bit k + 4 half of the plane; Q6_K: bits 2k.. of plane half
                        one = packing.high_bits == 1
                        plane, bit = (planes[0], k + 4 * half) if one else (planes[half], 2 * k)
                        mask = (1 << packing.high_bits) - 1
                        high = builder.and_(builder.lshr(plane, byte_splat(bit)), byte_splat(mask))
                        value = builder.or_(value, builder.shl(high, byte_splat(4)))
                    weights.append((builder.bitcast(value, ints), 16 * half + 4 * k))
            return weights, d, m, half_scales

        def added(i: ir.Value, block: ir.Value, unpacked: tuple) -> ir.Value:
            """What 32-value block `block` (unpacked) adds to activation row i's 16 lanes."""
            weights, d, m, half_scales = unpacked
            row_parts = builder.mul(i, builder.mul(cols, ir.Constant(cols.type, count)))
            x_at = builder.mul(block, ir.Constant(block.type, 32))

            def broadcast_x(part: int, value: int) -> ir.Value:
                """Values value..value+3 of the block's part `part` of row i, in every lane."""
                flat = builder.add(builder.add(row_parts, builder.mul(cols, ir.Constant(cols.type, part))),
                                   builder.add(x_at, ir.Constant(x_at.type, value)))
                word = builder.load(pointer(context, builder, parts_t, parts_v, flat, _INT), align=1)
                return splat(builder, word, LANES)

            halves = 2 if half_scales else 1  # Q6_K: values 0-15 and 16-31 summed apart
            # CHAINS independent sums in flight: one chain of dependent vpdpbusd waits out each one's
            # latency (integer sums: regrouping them changes no bit)
            chains = max(1, CHAINS // count)
            zero = ir.Constant(ints, [0] * LANES)
            totals = [[[zero] * chains for _ in range(count)] for _ in range(halves)]
            for n, (values, value) in enumerate(weights):  # the parts' independent chains interleaved
                t = totals[value // 16 if halves == 2 else 0]
                for part in range(count):
                    c = n % chains
                    t[part][c] = _dot_bytes(builder, t[part][c], values, broadcast_x(part, value), vnni)
            for t in totals:
                for part in range(count):
                    pending = t[part]
                    while len(pending) > 1:
                        pending = [builder.add(*pending[k : k + 2]) if k + 1 < len(pending) else pending[k]
                                   for k in range(0, len(pending), 2)]
                    t[part] = pending[0]

            def pair(first: ir.Value, second: ir.Value) -> ir.Value:  # first * 2^7 + second, exact as a float
                joined = builder.add(builder.shl(first, constant(_INT, [PART_BITS] * LANES)), second)
                return builder.sitofp(joined, floats)

            def combined(t: list[ir.Value]) -> ir.Value:
                if count == 1:
                    return builder.sitofp(t[0], floats)
                weight = ir.Constant(floats, [float(1 << 2 * PART_BITS)] * LANES)
                return builder.fadd(builder.fmul(pair(t[0], t[1]), weight), pair(t[2], t[3]))

            def load_splat(array_type, array, at: ir.Value) -> ir.Value:
                return splat(builder, builder.load(pointer(context, builder, array_type, array, at,
                                                           ir.FloatType())), LANES)

            cell = builder.add(builder.mul(i, blocks), block)
            row_scale = load_splat(scale_t, scale_v, cell)
            if halves == 2:
                sc0, sc1 = half_scales
                total = builder.fadd(builder.fmul(sc0, combined(totals[0])),
                                     builder.fmul(sc1, combined(totals[1])))
                half_cell = builder.mul(cell, const(2))
                s0 = load_splat(sums_t, sums_v, half_cell)
                s1 = load_splat(sums_t, sums_v, builder.add(half_cell, const(1)))
                offsets = builder.fadd(builder.fmul(sc0, s0), builder.fmul(sc1, s1))
                scaled = builder.fmul(row_scale, total)
                thirty_two = ir.Constant(floats, [32.0] * LANES)
                return builder.fmul(d, builder.fsub(scaled, builder.fmul(thirty_two, offsets)))
            total = combined(totals[0])
            row_sum = load_splat(sums_t, sums_v, cell)
            if m is None:  # Q8_0: take back the 128 added to every weight byte (exact: both under 2^24)
                total = builder.fsub(total, builder.fmul(row_sum, ir.Constant(floats, [128.0] * LANES)))
                return builder.fmul(d, builder.fmul(row_scale, total))
            return builder.fadd(builder.fmul(d, builder.fmul(row_scale, total)), builder.fmul(m, row_sum))

        def accumulate(contributions) -> None:
            """For every row i, acc[i, g..g+15] plus each contribution(i) in turn, loaded and stored once."""
            with cgutils.for_range(builder, rows) as loop:
                target = pointer(context, builder, acc_t, acc_v,
                                 builder.add(builder.mul(loop.index, acc_width), g_v), floats)
                total = builder.load(target, align=4)
                for contribution in contributions:
                    total = builder.fadd(total, contribution(loop.index))
                builder.store(total, target, align=4)

        if span_ == 1:  # one block for every row: unpacked once, before the rows' loop
            stored, sub = (b_v, const(0))
            if per > 1:  # b's block of the tile, and which of its sub-blocks
                stored, sub = builder.udiv(b_v, const(per)), builder.urem(b_v, const(per))
            unpacked = unpack(*stored_block(stored), sub)
            accumulate([lambda i: added(i, b_v, unpacked)])
        else:
            shared = stored_block(builder.udiv(b_v, const(per))) if per > 1 else None
            # The next span's bytes are asked for piece by piece, one piece before each block's dots:
            # the CPU's own prefetching streams slowly here, and a burst of a whole span's lines
            # stalls on the misses in flight. Into L2, not L1: decode ran faster on every model
            # (all three measured in docs/LOG.md); the next call's own lines go to L1 (next_group).
            span_bytes = builder.mul(builder.mul(type_size, lanes), const(span_ // per))
            piece = builder.udiv(span_bytes, builder.mul(builder.udiv(lanes, const(LANES)), const(span_)))
            span_first = builder.mul(builder.udiv(b_v, const(per)), builder.mul(type_size, lanes))
            first_piece = builder.mul(builder.udiv(g_v, const(LANES)), const(span_))

            def prefetch(k: int) -> None:
                at = builder.add(builder.add(span_first, span_bytes),
                                 builder.mul(builder.add(first_piece, const(k)), piece))
                prefetch_bytes(builder, builder.gep(w_data, [at]), piece, locality=2)

            def contribution(k: int):
                """Block b + k of the span, for row i (a K-quant's sub-block k of the shared block)."""
                def emit(i: ir.Value) -> ir.Value:
                    prefetch(k)
                    block = builder.add(b_v, const(k))
                    if shared is not None:
                        return added(i, block, unpack(*shared, const(k)))
                    return added(i, block, unpack(*stored_block(block), const(0)))

                return emit

            accumulate([contribution(k) for k in range(span_)])
        return context.get_dummy_value()

    return sig, codegen
