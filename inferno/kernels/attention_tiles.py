"""Decode attention's inner loops over a tile of TILE cached float32 rows, as LLVM IR: the tile's scores
summed across vector lanes together, and its values mixed into outputs held in registers.

A score is a dot product of head_dim values: vector multiply-adds, then a sum across the vector's
lanes. Summed one position at a time, that sum (a chain of shuffles and adds) and the loop around it
cost about as much as the products. Here each of a tile's TILE positions keeps a vector of partial
sums, and the TILE vectors are reduced together (transposed: each step halves the lanes of two vectors
and packs both into one), which leaves one vector holding the tile's scores in order. TILE is the
lane count of a vector (16 floats with AVX-512, else 8), so the partial sums fill half the registers.

Mixing the values, out[h] += sum_s w[h, s] * v_s, one position at a time loads and stores each output
vector once per position; here an output vector takes the tile's TILE rows before it is stored.
Numba cannot say either: its loops have no vector type to keep TILE partial sums in, and over slices
it reloads the output for every position (it cannot prove the rows and the output apart).

A tile reads TILE rows at once, a cache line of each per step, which the CPU's own prefetchers do
not follow (they watch one stream at a time): the first head's pass asks for the same lines `ahead`
values further on, into L2.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from inferno.kernels.jit import compiled_for
from inferno.kernels.llvm_ir import constant, pointer, prefetch_line, splat

TILE = 16 if compiled_for("+avx512f") else 8  # positions of a tile, float32 lanes of the widest vector
_INT = ir.IntType(32)
_FAST = ("fast",)  # products and sums contract to multiply-adds and may be reordered


def _transposed_sum(builder, vectors: list[ir.Value]) -> ir.Value:
    """The vector whose lane p is the sum of vectors[p]'s lanes (as many vectors as lanes, a power of two).

    Each step pairs the vectors: every group of lanes is halved (its upper half added to its lower
    half) and the halved groups of both vectors of a pair are packed into one. labels track which
    input vector each lane sums; a last shuffle puts the sums in order.
    """
    lanes = vectors[0].type.count
    labels = [[p] * lanes for p in range(len(vectors))]
    width = lanes  # lanes in a group summing one input vector
    while len(vectors) > 1:
        half = width // 2
        lower = [g + j for g in range(0, lanes, width) for j in range(half)]
        upper = [i + half for i in lower]
        paired = []
        for k in range(0, len(vectors), 2):
            (a, a_labels), (b, b_labels) = (vectors[k], labels[k]), (vectors[k + 1], labels[k + 1])
            low = builder.shuffle_vector(a, b, constant(_INT, lower + [lanes + i for i in lower]))
            high = builder.shuffle_vector(a, b, constant(_INT, upper + [lanes + i for i in upper]))
            paired.append((builder.fadd(low, high, flags=_FAST), [a_labels[i] for i in lower] +
                           [b_labels[i] for i in lower]))
        vectors, labels = [v for v, _ in paired], [lab for _, lab in paired]
        width = half
    order = [labels[0].index(p) for p in range(lanes)]
    return builder.shuffle_vector(vectors[0], vectors[0], constant(_INT, order))


def _float_arrays(*arrays) -> bool:
    return all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32 for a in arrays)


class _Tile:
    """The TILE rows a tile reads: rows[start + p * stride + j], a vector of TILE values at a time."""

    def __init__(self, context, builder, array_type, array, start, stride, ahead):
        self.context, self.builder = context, builder
        self.array_type, self.array = array_type, array
        self.start, self.stride, self.ahead = start, stride, ahead
        self.vector = ir.VectorType(ir.FloatType(), TILE)

    def _at(self, p: int, j: ir.Value) -> ir.Value:
        b = self.builder
        return b.add(b.add(self.start, b.mul(ir.Constant(j.type, p), self.stride)), j)

    def load(self, p: int, j: ir.Value) -> ir.Value:
        at = pointer(self.context, self.builder, self.array_type, self.array, self._at(p, j), self.vector)
        return self.builder.load(at, align=4)

    def prefetch(self, p: int, j: ir.Value, ask: ir.Value) -> None:
        """When `ask` (an i1): ask for the line of position p's values j.. `ahead` values further on."""
        with self.builder.if_then(ask, likely=False):
            at = self.builder.add(self._at(p, j), self.ahead)
            prefetch_line(self.builder, pointer(self.context, self.builder, self.array_type, self.array, at,
                                                ir.IntType(8)), locality=2)


@intrinsic
def score_tile(typingctx, q, q_at, rows, r_at, r_stride, heads, head_dim, weights, w_at, w_stride, scale,
               ahead):
    """weights[w_at + i * w_stride + p] = scale * sum_j q[q_at + i * head_dim + j] * rows[r_at + p * r_stride
    + j] for the tile's positions p < TILE, heads i < heads (the query heads of one KV head, one after
    the other in q) and j < head_dim (a multiple of TILE); asks for the rows `ahead` values on. All
    arrays float32, indexed flat."""
    if not _float_arrays(q, rows, weights):
        return None
    n = types.intp
    sig = types.void(q, n, rows, n, n, n, n, weights, n, n, types.float32, n)

    def codegen(context, builder, signature, args):
        q_v, q_at_v, rows_v, r_at_v, r_stride_v, heads_v, dim_v, w_v, w_at_v, w_stride_v, scale_v, ahead_v = (
            args)
        tile = _Tile(context, builder, signature.args[2], rows_v, r_at_v, r_stride_v, ahead_v)
        zero, step = ir.Constant(dim_v.type, 0), ir.Constant(dim_v.type, TILE)
        sums = [cgutils.alloca_once(builder, tile.vector) for _ in range(TILE)]
        with cgutils.for_range(builder, heads_v) as head:
            for s in sums:
                builder.store(ir.Constant(tile.vector, None), s)
            first = builder.icmp_signed("==", head.index, zero)
            q_head = builder.add(q_at_v, builder.mul(head.index, dim_v))
            with cgutils.for_range_slice(builder, zero, dim_v, step) as (j, _):
                part = pointer(context, builder, signature.args[0], q_v, builder.add(q_head, j), tile.vector)
                q_part = builder.load(part, align=4)
                for p, s in enumerate(sums):
                    product = builder.fmul(q_part, tile.load(p, j), flags=_FAST)
                    builder.store(builder.fadd(builder.load(s), product, flags=_FAST), s)
                    tile.prefetch(p, j, first)
            scores = _transposed_sum(builder, [builder.load(s) for s in sums])
            scaled = builder.fmul(scores, splat(builder, scale_v, TILE), flags=_FAST)
            target = builder.add(w_at_v, builder.mul(head.index, w_stride_v))
            at = pointer(context, builder, signature.args[7], w_v, target, tile.vector)
            builder.store(scaled, at, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def mix_tile(typingctx, weights, w_at, w_stride, rows, r_at, r_stride, heads, head_dim, out, o_at, ahead):
    """out[o_at + i * head_dim + j] += sum_p weights[w_at + i * w_stride + p] * rows[r_at + p * r_stride + j]
    for the tile's positions p < TILE, heads i < heads (the query heads of one KV head) and j < head_dim
    (a multiple of TILE); asks for the rows `ahead` values on. All arrays float32, indexed flat."""
    if not _float_arrays(weights, rows, out):
        return None
    n = types.intp
    sig = types.void(weights, n, n, rows, n, n, n, n, out, n, n)

    def codegen(context, builder, signature, args):
        w_v, w_at_v, w_stride_v, rows_v, r_at_v, r_stride_v, heads_v, dim_v, out_v, o_at_v, ahead_v = args
        tile = _Tile(context, builder, signature.args[3], rows_v, r_at_v, r_stride_v, ahead_v)
        zero, step = ir.Constant(dim_v.type, 0), ir.Constant(dim_v.type, TILE)
        coefs = [cgutils.alloca_once(builder, tile.vector) for _ in range(TILE)]
        with cgutils.for_range(builder, heads_v) as head:
            w_head = builder.add(w_at_v, builder.mul(head.index, w_stride_v))
            at = pointer(context, builder, signature.args[0], w_v, w_head, tile.vector)
            w_tile = builder.load(at, align=4)
            for p, c in enumerate(coefs):
                builder.store(splat(builder, builder.extract_element(w_tile, ir.Constant(_INT, p)), TILE), c)
            first = builder.icmp_signed("==", head.index, zero)
            o_head = builder.add(o_at_v, builder.mul(head.index, dim_v))
            with cgutils.for_range_slice(builder, zero, dim_v, step) as (j, _):
                o_at = builder.add(o_head, j)
                target = pointer(context, builder, signature.args[8], out_v, o_at, tile.vector)
                total = builder.load(target, align=4)
                for p, c in enumerate(coefs):
                    total = builder.fadd(total, builder.fmul(builder.load(c), tile.load(p, j), flags=_FAST),
                                         flags=_FAST)
                    tile.prefetch(p, j, first)
                builder.store(total, target, align=4)
        return context.get_dummy_value()

    return sig, codegen
