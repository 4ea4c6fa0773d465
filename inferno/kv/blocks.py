"""Numba kernels for cache rows kept in a compact element type: encoding rows as they are written,
decoding them back, and decode attention that reads the stored rows directly.

A stored row is the bytes of one token's K (or V) in one layer, all KV heads side by side:
- FMT_F16: IEEE half floats, 2 bytes a value;
- FMT_Q8_0, FMT_Q4_0: llama.cpp's blocks of 32 values along head_dim, byte for byte (an f16 scale d,
  then 32 int8 values x = d * q, or 16 bytes of 4-bit q with x = d * (q - 8): low nibbles hold the
  block's first 16 values, high nibbles the last 16).

With `rotate`, each head's 64 (any power of two) values are multiplied by the orthonormal Hadamard
matrix before they are rounded: the few huge channels of a key (RoPE's slow dimensions) are spread
over all of them, so one block scale fits them all. The rotation is its own inverse, and attention
never needs to undo it on the cache: q . k = (Hq) . (Hk), and sum_s w_s Hv_s = H (sum_s w_s v_s), so
the query is rotated once and the output rotated back once per step.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic, overload

from inferno.kernels import attention
from inferno.kernels.attention import combine_spans_into, mix_values, score_span, softmax_span
from inferno.kernels.jit import njit
from inferno.kernels.llvm_ir import prefetch_ahead
from inferno.kv.vectors import PACK_F16, PACK_Q4, PACK_Q8, block_axpys, block_dots

FMT_F32, FMT_F16, FMT_Q8_0, FMT_Q4_0, FMT_Q4_64 = -1, 0, 1, 2, 3  # FMT_F32: float32 rows as computed
BLOCK = 32  # values per q8_0 / q4_0 block


@njit(cache=True)
def block_values(fmt: int) -> int:
    """Values sharing one f16 scale."""
    return 2 * BLOCK if fmt == FMT_Q4_64 else BLOCK


@njit(cache=True)
def block_bytes(fmt: int) -> int:
    """Bytes of the values sharing one scale, the f16 scale included."""
    return 18 if fmt == FMT_Q4_0 else 34


@intrinsic
def half_to_float(typingctx, bits):
    """The float32 value of the IEEE half whose bits are the uint16 `bits` (exact)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def float_to_half(typingctx, x):
    """The bits of the IEEE half nearest the float32 `x` (ties to even, as numpy's astype)."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@njit(cache=True, fastmath=True)
def hadamard_rows(x: np.ndarray, head_dim: int) -> None:
    """Each head_dim slice of each row of x [n, w] times the orthonormal Hadamard matrix, in place
    (fast Walsh-Hadamard transform: log2(head_dim) passes of butterflies, then 1/sqrt(head_dim))."""
    norm = np.float32(1.0 / math.sqrt(head_dim))
    for i in range(x.shape[0]):
        for base in range(0, x.shape[1], head_dim):
            h = x[i, base : base + head_dim]
            step = 1
            while step < head_dim:
                for start in range(0, head_dim, 2 * step):
                    for j in range(start, start + step):
                        a, b = h[j], h[j + step]
                        h[j], h[j + step] = a + b, a - b
                step *= 2
            for j in range(head_dim):
                h[j] *= norm


@njit(cache=True)
def half_at(row: np.ndarray, o: int) -> float:
    """The f16 stored little-endian at bytes o, o + 1 of a uint8 row (a block's scale), as float32."""
    return half_to_float(np.uint16(row[o]) | (np.uint16(row[o + 1]) << 8))


@njit(cache=True)
def encode_rows(x: np.ndarray, fmt: int, out: np.ndarray) -> None:
    """Rows x [n, w] float32 stored as `fmt` into out [n, row_bytes] uint8.

    No fastmath: scales and rounding follow llama.cpp's reference quantizers (and gguf-py's) to the bit,
    which a reciprocal approximation of `/ 127` would break.
    """
    n, w = x.shape
    if fmt == FMT_F16:
        halves = out.view(np.uint16)
        for i in range(n):
            for j in range(w):
                halves[i, j] = float_to_half(x[i, j])
        return
    size, span = block_bytes(fmt), block_values(fmt)
    for i in range(n):
        for b in range(w // span):
            src = x[i, b * span : (b + 1) * span]
            dst = out[i, b * size : (b + 1) * size]
            if fmt == FMT_Q8_0:
                amax = np.float32(0.0)
                for j in range(BLOCK):
                    amax = max(amax, abs(src[j]))
                d = amax / np.float32(127.0)
                inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
                for j in range(BLOCK):
                    v = src[j] * inv
                    a = abs(v)
                    r = np.floor(a) + np.floor(np.float32(2.0) * (a - np.floor(a)))  # roundf: ties away
                    dst[2 + j] = np.uint8(np.int32(r if v >= 0 else -r) & 0xFF)
            else:
                top = src[0]
                for j in range(1, span):
                    if abs(src[j]) > abs(top):
                        top = src[j]
                d = top / np.float32(-8.0)
                inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
                for part in range(span // BLOCK):
                    at = part * BLOCK
                    for j in range(BLOCK // 2):
                        lo = min(15, int(src[at + j] * inv + np.float32(8.5)))
                        hi = min(15, int(src[at + j + BLOCK // 2] * inv + np.float32(8.5)))
                        dst[2 + at // 2 + j] = np.uint8(lo | (hi << 4))
            bits = float_to_half(d)
            dst[0] = np.uint8(bits & 0xFF)
            dst[1] = np.uint8(bits >> 8)


@njit(cache=True, fastmath=True)
def decode_rows(raw: np.ndarray, fmt: int, out: np.ndarray) -> None:
    """Stored rows raw [n, row_bytes] back to float32 out [n, w]."""
    n, w = out.shape
    if fmt == FMT_F16:
        halves = raw.view(np.uint16)
        for i in range(n):
            for j in range(w):
                out[i, j] = half_to_float(halves[i, j])
        return
    size, span = block_bytes(fmt), block_values(fmt)
    signed = raw.view(np.int8)
    for i in range(n):
        for b in range(w // span):
            o = b * size
            d = half_at(raw[i], o)
            dst = out[i, b * span : (b + 1) * span]
            if fmt == FMT_Q8_0:
                quants = signed[i, o + 2 : o + 2 + BLOCK]
                for j in range(BLOCK):
                    dst[j] = d * np.float32(quants[j])
            else:
                nibbles = raw[i, o + 2 : o + 2 + span // 2]
                for part in range(span // BLOCK):
                    at = part * BLOCK
                    for j in range(BLOCK // 2):
                        byte = nibbles[at // 2 + j]
                        dst[at + j] = d * np.float32(np.int32(byte & 0xF) - 8)
                        dst[at + j + BLOCK // 2] = d * np.float32(np.int32(byte >> 4) - 8)


@njit(cache=True)
def _layout(fmt: int, n_heads: int, width: int, row_bytes: int) -> tuple[int, int, int, int, int, int]:
    """How stored rows of `fmt` ([row_bytes] each) line up with n_heads query heads of `width` values
    in all: how the blocks are packed for the vector loads, their bytes (f16 rows: "blocks" of 32
    halves, no scale), the bytes before a block's values (its scale), head_dim, blocks per head and
    query heads per KV head."""
    if fmt == FMT_F16:
        packing, size, first = PACK_F16, 2 * BLOCK, 0
    else:
        packing, size, first = (PACK_Q8 if fmt == FMT_Q8_0 else PACK_Q4), block_bytes(fmt), 2
    head_dim = width // n_heads
    per_head = head_dim // BLOCK
    return packing, size, first, head_dim, per_head, n_heads // (row_bytes // size // per_head)


@njit(cache=True)
def _scale(packing: int, row: np.ndarray, o: int) -> float:
    """The f16 scale at byte o of a stored block (1 for f16 rows, which have none)."""
    if packing == PACK_F16:
        return np.float32(1.0)
    return half_at(row, o)


@njit(cache=True, fastmath=True)
def score_rows(q: np.ndarray, keys: np.ndarray, fmt: int, n_heads: int, weights: np.ndarray) -> None:
    """weights[h, s] = q_h . key s (its KV head), over stored rows keys [S, row_bytes] of `fmt`."""
    score_rows_at(q, keys, fmt, n_heads, weights, 0)


@njit(cache=True, fastmath=True)
def score_rows_at(q: np.ndarray, keys: np.ndarray, fmt: int, n_heads: int, weights: np.ndarray,
                  col: int) -> None:
    """weights[h, col + s] = q_h . key s (its KV head), over stored rows keys [S, row_bytes] of `fmt`.
    Each stored block is converted once for all the query heads of its KV head."""
    packing, size, first, head_dim, per_head, group = _layout(fmt, n_heads, q.shape[0], keys.shape[1])
    n_kv, width = n_heads // group, weights.shape[1]
    for h in range(n_heads):
        for s in range(keys.shape[0]):
            weights[h, col + s] = 0.0
    for s in range(keys.shape[0]):
        prefetch_ahead(keys, s)
        for g in range(n_kv):
            for b in range(per_head):
                o = (g * per_head + b) * size
                block_dots(packing, q, g * group * head_dim + b * BLOCK, head_dim, group, keys[s], o + first,
                           weights, g * group * width + col + s, width, _scale(packing, keys[s], o))


@njit(cache=True, fastmath=True)
def mix_rows(weights: np.ndarray, values: np.ndarray, fmt: int, n_heads: int, out: np.ndarray) -> None:
    """out[h] += sum_s weights[h, s] * value s (its KV head), over stored rows values [S, row_bytes]."""
    mix_rows_at(weights, values, fmt, n_heads, out, 0)


@njit(cache=True, fastmath=True)
def mix_rows_at(weights: np.ndarray, values: np.ndarray, fmt: int, n_heads: int, out: np.ndarray,
                col: int) -> None:
    """out[h] += sum_s weights[h, col + s] * value s (its KV head), over stored rows values [S, row_bytes].
    Each stored block is converted once for all the query heads of its KV head."""
    packing, size, first, head_dim, per_head, group = _layout(fmt, n_heads, out.shape[0], values.shape[1])
    n_kv, width = n_heads // group, weights.shape[1]
    for s in range(values.shape[0]):
        prefetch_ahead(values, s)
        for g in range(n_kv):
            for b in range(per_head):
                o = (g * per_head + b) * size
                block_axpys(packing, out, g * group * head_dim + b * BLOCK, head_dim, group, weights,
                            g * group * width + col + s, width, _scale(packing, values[s], o), values[s],
                            o + first)


def score_run(q: np.ndarray, keys: np.ndarray, fmt: int, n_heads: int, weights: np.ndarray, col: int) -> None:
    """The scores of a run of rows keys [n, row] into weights[:, col : col + n]: float32 rows
    (attention.score_span) or stored ones of `fmt` (score_rows_at). Chosen by the rows' type as the
    kernel compiles (`overload`), so a kernel over one storage carries no code for the other."""


def mix_run(weights: np.ndarray, values: np.ndarray, fmt: int, n_heads: int, out: np.ndarray,
            col: int) -> None:
    """out += the run of rows values [n, row] mixed by weights[:, col : col + n] (as score_run)."""


@overload(score_run, jit_options={"fastmath": True})
def _score_run(q, keys, fmt, n_heads, weights, col):
    if keys.dtype == types.float32:
        return lambda q, keys, fmt, n_heads, weights, col: score_span(q, keys, n_heads, weights, col)
    return lambda q, keys, fmt, n_heads, weights, col: score_rows_at(q, keys, fmt, n_heads, weights, col)


@overload(mix_run, jit_options={"fastmath": True})
def _mix_run(weights, values, fmt, n_heads, out, col):
    if values.dtype == types.float32:
        return lambda weights, values, fmt, n_heads, out, col: mix_values(weights, values, n_heads, out, col)
    return lambda weights, values, fmt, n_heads, out, col: mix_rows_at(weights, values, fmt, n_heads, out,
                                                                       col)


@njit(cache=True, fastmath=True)
def _each_run(q: np.ndarray, rows: np.ndarray, table: np.ndarray, block_size: int, p0: int, p1: int,
              fmt: int, n_heads: int, weights: np.ndarray, out: np.ndarray, mix: bool) -> None:
    """score_run (or mix_run) over positions p0 .. p1 - 1 of a sequence, one contiguous run of rows
    per block: position p is row table[p // block_size] * block_size + p % block_size of rows."""
    p, col = p0, 0
    while p < p1:
        index = p // block_size
        offset = p - index * block_size
        n = min(block_size - offset, p1 - p)
        r = np.int64(table[index]) * block_size + offset
        if mix:
            mix_run(weights, rows[r : r + n], fmt, n_heads, out, col)
        else:
            score_run(q, rows[r : r + n], fmt, n_heads, weights, col)
        p += n
        col += n


@njit(cache=True, fastmath=True)
def span_of_tables(query: np.ndarray, keys: np.ndarray, values: np.ndarray, table: np.ndarray,
                   block_size: int, p0: int, p1: int, fmt: int, n_heads: int, out: np.ndarray,
                   stats: np.ndarray) -> None:
    """One query over positions p0 .. p1 - 1 of its sequence (one span), softmax left unnormalised
    (flash-decoding): for each head h, out[h] = sum_s exp(score_s - m) * v_s and stats[h] = (m, sum_s
    exp(score_s - m)), m the span's largest score, so spans combine exactly (combine_spans)."""
    weights = np.empty((n_heads, p1 - p0), np.float32)
    _each_run(query, keys, table, block_size, p0, p1, fmt, n_heads, weights, out, False)
    softmax_span(weights, p1 - p0, stats)
    for j in range(out.shape[0]):
        out[j] = 0.0
    _each_run(query, values, table, block_size, p0, p1, fmt, n_heads, weights, out, True)


@njit(cache=True, fastmath=True)
def _queries(q: np.ndarray, fmt: int, rotate: bool, head_dim: int) -> np.ndarray:
    """The queries as the rows' scores take them: float32 rows scale their scores, stored rows take the
    query scaled (and rotated like them)."""
    query = q.copy()
    if fmt != FMT_F32:
        if rotate:
            hadamard_rows(query, head_dim)
        scale = np.float32(1.0 / math.sqrt(head_dim))
        for b in range(query.shape[0]):
            for j in range(query.shape[1]):
                query[b, j] *= scale
    return query


@njit(cache=True)
def _first_spans(ranges: np.ndarray) -> np.ndarray:
    """first[b] .. first[b + 1] - 1: the spans of sequence b (ranges [B, (start, end, span)])."""
    first = np.empty(ranges.shape[0] + 1, np.int64)
    first[0] = 0
    for b in range(ranges.shape[0]):
        first[b + 1] = first[b] + (ranges[b, 1] - ranges[b, 0] + ranges[b, 2] - 1) // ranges[b, 2]
    return first


@njit(cache=True)
def _owner(first: np.ndarray, t: int) -> int:
    """The sequence whose spans hold span t: the last b with first[b] <= t (and a span of its own)."""
    lo, hi = 0, first.shape[0] - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if first[mid] <= t:
            lo = mid
        else:
            hi = mid - 1
    return lo


@njit(cache=True, fastmath=True)
def _combine(partial: np.ndarray, stats: np.ndarray, first: np.ndarray, n_heads: int, fmt: int,
             rotate: bool) -> np.ndarray:
    """Each sequence's spans combined (combine_spans), its heads rotated back when the rows are."""
    n_seq, width = first.shape[0] - 1, partial.shape[1]
    out = np.empty((n_seq, width), np.float32)
    for b in range(n_seq):
        combine_spans_into(partial[first[b] : first[b + 1]], stats[first[b] : first[b + 1]], n_heads, out[b])
    if fmt != FMT_F32 and rotate:
        hadamard_rows(out, width // n_heads)
    return out


@njit(cache=True, fastmath=True, parallel=True)
def attend_tables(q: np.ndarray, keys: np.ndarray, values: np.ndarray, tables: np.ndarray, ranges: np.ndarray,
                  block_size: int, n_heads: int, fmt: int, rotate: bool) -> np.ndarray:
    """Decode attention of B queries, one per sequence, over rows of one layer: every cache layout's.

    q [B, n_heads * head_dim]; keys, values [R, row] (float32 rows when fmt is FMT_F32, else stored rows
    of `fmt`); sequence b's position p is row tables[b, p // block_size] * block_size + p % block_size
    (prealloc: one block as long as its capacity; paged: the pool's blocks); ranges int64 [B, 3]: the
    positions b attends, start .. end - 1, and its span (attention.decode_span, read by the caller at
    each call: a thread count compiled into a cached kernel goes stale).

    Every sequence's positions are cut into spans; all spans of all sequences run in parallel
    (span_of_tables: its rows scored a run, the rows of one block, at a time, its unnormalised softmax
    mixing the values); then each sequence's spans are rescaled to its largest score and summed
    (combine_spans). With `rotate` the rows hold Hadamard-rotated heads (see the module).

    The prange is this function's only parallel loop: everything else is in plain kernels it calls,
    where Numba makes no array expression a parallel loop of its own (each such loop costs a launch
    of the thread pool, about a microsecond, even on one thread).
    """
    width = q.shape[1]
    query = _queries(q, fmt, rotate, width // n_heads)
    first = _first_spans(ranges)
    n_spans = first[-1]
    partial = np.empty((n_spans, width), np.float32)
    stats = np.empty((n_spans, n_heads, 2), np.float32)
    for t in prange(n_spans):
        b = _owner(first, t)
        p0 = ranges[b, 0] + (t - first[b]) * ranges[b, 2]
        p1 = min(p0 + ranges[b, 2], ranges[b, 1])
        span_of_tables(query[b], keys, values, tables[b], block_size, p0, p1, fmt, n_heads, partial[t],
                       stats[t])
    return _combine(partial, stats, first, n_heads, fmt, rotate)


ONE_BLOCK = np.zeros((1, 1), np.int32)  # the table of rows stored in order: one block holding them all
_RANGES: dict[tuple[int, int, int], np.ndarray] = {}


def one_range(start: int, end: int) -> np.ndarray:
    """ranges [[start, end, span]] of one query over positions start .. end - 1, its span from
    attention.decode_span (outside the kernel, for the thread count of this process), kept per (start,
    end, threads): every layer of a decode step asks for the same one, and building it (decode_span and
    a small array) cost a microsecond and a half a call, against 6 of the whole call at depth 16."""
    key = (start, end, numba.config.NUMBA_NUM_THREADS)
    ranges = _RANGES.get(key)
    if ranges is None:
        if len(_RANGES) >= 256:
            _RANGES.clear()
        ranges = _RANGES[key] = np.array([[start, end, attention.decode_span(end - start)]], np.int64)
    return ranges


def attend_rows(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, end: int, n_heads: int,
                fmt: int = FMT_F32, rotate: bool = False) -> np.ndarray:
    """attend_tables for one query q [n_heads * head_dim] over rows start .. end - 1 of keys, values
    [S, row] stored in order (prealloc's layer, or float rows anywhere): one block of S rows."""
    return attend_tables(q[None], keys, values, ONE_BLOCK, one_range(start, end), keys.shape[0] or 1, n_heads,
                         fmt, rotate)[0]


def attention_decode_rows(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, n_heads: int, fmt: int, rotate: bool
) -> np.ndarray:
    """attention.attention_decode over stored rows keys, values [S, row_bytes] uint8 of format `fmt`.

    Each stored block of 32 values is read straight into vector registers (`inferno.kv.vectors`): a
    query head's score is a vector dot per block times the block's scale, and the values are added
    into the output per block with weight times scale. The cache is read once in its compact form and
    never decoded into a float copy. With `rotate` the rows hold Hadamard-rotated heads (see the module).
    """
    return attend_rows(q, keys, values, 0, keys.shape[0], n_heads, fmt, rotate)
