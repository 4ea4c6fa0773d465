"""Weight matrices kept in their GGUF block type, with Numba kernels that compute straight from the blocks.

Layout. At load time a matrix's blocks are regrouped into tiles of `lanes` rows: uint8[tile, block,
byte, lane], i.e. byte p of block b of row `tile * lanes + lane` sits at [tile, b, p, lane]. The same
byte of `lanes` consecutive rows is contiguous, so the kernels loop over lanes (rows) innermost and
LLVM turns that into plain SIMD loads with no per-block horizontal sums. Q4_0 and Q4_1 blocks keep
their scales that way, but their 16 nibble bytes go by quads: the block's bytes from `qs` on are
uint8[quad k, lane, 4], bytes 4k..4k+3 of each row side by side, the shape of the CPU's byte dot
product (see inferno.kernels.nibble_dots). Only the order changes, so memory stays the size of the file's
tensor.

Arithmetic. Dequantization repeats gguf-py's float32 operations in the same order (no fast-math, so no
fused multiply-adds) and is bit-identical to `gguf.quants.dequantize`. The matrix-vector kernels
regroup the sums: for Q4_1, dot(x, d*q + m) over a block is d*sum(x*q) + m*sum(x), with the block
sums of x computed once per call; the packed types (4, 5 and 6 bits) take sum(x*q) in integers, from
x split into int8 parts once per call (inferno.kernels.activation_parts; Q8_0 too when x is rounded to
int8), the others in float32.

Compilation. Kernels are built per GGML type on first use (see `_kernels`) and cached on disk by Numba.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import NamedTuple

import gguf
import numba
import numpy as np
from gguf import GGMLQuantizationType as QType
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from inferno.errors import InfernoError
from inferno.kernels.activation_parts import ACTIVATIONS, integer_activations, sums_size
from inferno.kernels.dequant import DEQUANTIZE, dequantize_tile, zero
from inferno.kernels.ggml import Q4_K, Q5_K, Q6_K, Q8_0
from inferno.kernels.jit import njit
from inferno.kernels.llvm_ir import halves_to_floats, pointer, prefetch_row, splat
from inferno.kernels.nibble_dots import LANES as NIBBLE_LANES
from inferno.kernels.nibble_dots import PACKED, SPAN, quant_dots
from inferno.kernels.repack import IN_MEMORY, TILE_BYTES, TileStore, read_tiles
from inferno.kernels.sharing import in_spans

TILE_ROWS = 32  # lanes per tile: full SIMD loops, yet enough tiles to share small matrices between threads
# The packed types' tiles (PACKED): 64 lanes at least (1.2x faster than 32; Q8_0 is 1.4x slower on 64),
# wider for matrices with many rows (tile_lanes)
PACKED_TILE_ROWS = (256, 128, 64)
MIN_TILES = 12  # fewest tiles a wider layout may cut a matrix into: 6 a thread on 2, 3 on 4
MATMUL_CHUNK_BYTES = 8 << 20  # float32 scratch holding one chunk of dequantized rows in matmul
SPAN_BYTES = 128 << 10  # at most this much of W.T written between two spans (a core's cache holds it)
SUMS = 4  # independent float sums per Q8_0 block (_q8_0_block)
MATMUL_MIN_ROWS = 8  # below this many rows of x, matvec per row beats dequantizing the weight for BLAS

SUPPORTED = (QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0,
             QType.Q5_1, QType.Q4_K, QType.Q5_K, QType.Q6_K)
# Types whose matvec computes from the blocks; the others dequantize a tile at a time and take dots.
FUSED = (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q4_K, QType.Q5_K, QType.Q6_K)

K_SUB_BLOCKS = PACKED[Q4_K].sub_blocks


def integer_parts(qtype: int, activations: str) -> int:
    """How many int8 parts a matvec of this type splits x into under `activations` (see
    activation_parts.ACTIVATIONS); 0: it multiplies in float32. The packed types always take integers (four
    parts keep float32's precision); Q8_0 only with one part ("int8"), where they pay."""
    parts = ACTIVATIONS[activations]
    return parts if qtype in PACKED or (qtype == Q8_0 and parts == 1) else 0

_thread_scratch = threading.local()  # each thread's matmul scratch, grown on demand


def uses_blas(n_rows: int) -> bool:
    """The one decision between kernels: x of n_rows rows goes through BLAS matmul on dequantized
    chunks, or through one matrix-vector product per row (decode, short prompts)."""
    return n_rows >= MATMUL_MIN_ROWS


class QuantizedMatrix:
    """A 2-D weight [rows=out_features, cols=in_features] kept in its GGUF block type."""

    def __init__(self, name: str, qtype: QType, rows: int, cols: int, tiles: np.ndarray):
        self.name, self.qtype, self.rows, self.cols = name, qtype, rows, cols
        self.nbytes = tiles.nbytes
        self._tiles = tiles
        self._kernels = _kernels(int(qtype))
        self._matvec = _matvec(int(qtype), integer_parts(int(qtype), "f32"))
        self._activations = "f32"
        self.parts = [(0, rows)]  # (first row, rows) of each stacked weight (see from_tensors)
        self.part_names = [name]  # the weight in each part

    @classmethod
    def from_tensor(cls, tensor: gguf.ReaderTensor) -> QuantizedMatrix:
        return cls.from_tensors([tensor])

    @classmethod
    def from_tensors(cls, tensors: list[gguf.ReaderTensor], store: TileStore = IN_MEMORY) -> QuantizedMatrix:
        """The rows of several weights of one block type and row length, one weight after another,
        each starting on a tile boundary (see `parts`): one kernel call computes them all.

        store: where the tiles are built (in memory by default; the prepared-model cache builds them in
        its file)."""
        shapes = [matrix_shape(t) for t in tensors]
        qtype, cols = shapes[0][0], shapes[0][2]
        if any((q, c) != (qtype, cols) for q, _, c in shapes):
            raise ValueError(f"cannot stack {[t.name for t in tensors]}: block types or row lengths differ")
        shape, parts = tile_layout(qtype, [rows for _, rows, _ in shapes], cols)
        tiles = store.empty(shape)
        lanes = shape[3]
        for tensor, (first, rows) in zip(tensors, parts, strict=True):
            read_tiles(tensor, rows, tiles[first // lanes : (first + rows + lanes - 1) // lanes], store)
        return cls.from_tiles([t.name for t in tensors], qtype, cols, tiles, parts)

    @classmethod
    def from_tiles(
        cls, names: list[str], qtype: QType, cols: int, tiles: np.ndarray, parts: list[tuple[int, int]]
    ) -> QuantizedMatrix:
        """Weights `names` already in tiles (as from_tensors lays them out, parts included); tiles
        of another shape, type or layout are refused (ValueError), never indexed out of bounds."""
        shape, want = tile_layout(qtype, [rows for _, rows in parts], cols)
        if len(names) != len(parts) or list(map(tuple, parts)) != want:
            raise ValueError(f"{'+'.join(names)}: parts {parts} are not those of its rows")
        if tiles.dtype != np.uint8 or tiles.shape != shape or not tiles.flags.c_contiguous:
            raise ValueError(f"{'+'.join(names)}: tiles {tiles.dtype} {tiles.shape}, expected uint8 {shape}")
        matrix = cls("+".join(names), qtype, sum(parts[-1]), cols, tiles)
        matrix.parts, matrix.part_names = [tuple(p) for p in parts], list(names)
        return matrix

    @property
    def activations(self) -> str:
        """How matvec takes x (a name in activation_parts.ACTIVATIONS): "f32", float32's precision, the
        default; "int8", one int8 part per value (the packed types and Q8_0; the others stay float32)."""
        return self._activations

    @activations.setter
    def activations(self, name: str) -> None:
        if name not in ACTIVATIONS:
            raise ValueError(f"activations {name!r}: expected one of {', '.join(ACTIVATIONS)}")
        self._activations = name
        self._matvec = _matvec(int(self.qtype), integer_parts(int(self.qtype), name))

    @property
    def tiles(self) -> np.ndarray:
        """The blocks, uint8[tile, block, byte, lane] (see the module's Layout)."""
        return self._tiles

    def first_tile(self) -> QuantizedMatrix:
        """The rows of this matrix's first tile as a matrix of their own: the same kernels on a few rows
        (the warm-up runs the BLAS path's kernels on it, not on the whole weight)."""
        lanes = self._tiles.shape[3]
        return QuantizedMatrix(self.name, self.qtype, min(lanes, self.rows), self.cols, self._tiles[:1])

    def __repr__(self) -> str:
        return f"QuantizedMatrix({self.name!r}, {self.qtype.name}, rows={self.rows}, cols={self.cols})"

    def matvec(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """W @ x: float32[cols] -> float32[rows]."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape != (self.cols,):
            raise ValueError(f"{self.name}: matvec needs x of shape ({self.cols},), got {x.shape}")
        if out is None:
            out = np.empty(self.rows, np.float32)
        elif out.shape != (self.rows,) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"{self.name}: out must be contiguous float32 of shape ({self.rows},)")
        # As many chunks of tiles as Numba may ever run threads (numba.get_num_threads() costs more than a
        # small matvec's arithmetic); prange spreads them over the threads currently enabled.
        self._matvec(self._tiles, x, out, numba.config.NUMBA_NUM_THREADS)
        return out

    def matmul(self, x: np.ndarray, part: int | None = None) -> np.ndarray:
        """x @ W.T: float32[n, cols] -> float32[n, rows], for prefill; with `part`, only the rows of
        that stacked weight (see from_tensors). Dequantizes a chunk of tiles at a time into a scratch
        holding W.T's columns, and hands it to BLAS; each thread takes its own chunks (kernels.sharing)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.cols:
            raise ValueError(f"{self.name}: matmul needs x of shape (n, {self.cols}), got {x.shape}")
        if len(x) == 1 and part is None:  # a decode step's product: the matvec alone
            return self.matvec(x[0]).reshape(1, self.rows)
        start, rows = (0, self.rows) if part is None else self.parts[part]
        out = np.empty((x.shape[0], rows), np.float32)
        if not uses_blas(x.shape[0]):
            for i, v in enumerate(x):
                if part is None:
                    self.matvec(v, out[i])
                else:
                    out[i] = self.matvec(v)[start : start + rows]
            return out
        lanes = self._tiles.shape[3]
        tiles = self._tiles[start // lanes : (start + rows + lanes - 1) // lanes]
        tile_bytes = 4 * self.cols * lanes  # of a dequantized tile

        def multiply(lo: int, hi: int) -> None:
            """Tiles lo..hi, a chunk of at most MATMUL_CHUNK_BYTES at a time: dequantized, then handed to
            BLAS, in this thread (both release Python's lock)."""
            chunks = -(-(hi - lo) * tile_bytes // MATMUL_CHUNK_BYTES)
            step = -(-(hi - lo) // chunks)  # tiles per chunk: equal chunks
            w_t = _matmul_scratch(self.cols * step * lanes)
            for first in range(lo, hi, step):
                n = min(step, hi - first)
                chunk = w_t[: self.cols * n * lanes].reshape(self.cols, n * lanes)
                span = blocks_per_span(self.qtype, chunk)
                self._kernels.dequantize_transposed(tiles[first : first + n], chunk, span)
                m = min(n * lanes, rows - first * lanes)  # the last tile's padding rows are dropped
                np.matmul(x, chunk[:, :m], out=out[:, first * lanes : first * lanes + m])

        in_spans(multiply, len(tiles), 2.0 * x.shape[0] * rows * self.cols)
        return out

    def dequantize(self) -> np.ndarray:
        """float32[rows, cols], bit-identical to gguf.quants.dequantize."""
        return self.rows_at(np.arange(self.rows))

    def rows_at(self, ids: np.ndarray) -> np.ndarray:
        """float32[len(ids), cols]: the rows `ids` dequantized (an embedding lookup)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.rows):
            raise IndexError(f"{self.name}: row ids must be in [0, {self.rows})")
        out = np.empty((ids.size, self.cols), np.float32)
        self._kernels.dequantize_rows(self._tiles, ids, out)
        return out


def blocks_per_span(qtype: QType, out_t: np.ndarray) -> int:
    """How many blocks of every tile dequantize_transposed writes into W.T [cols, rows] at a time: the
    rows of out_t they fill stay within SPAN_BYTES (at least one block)."""
    return max(1, SPAN_BYTES // (gguf.GGML_QUANT_SIZES[qtype][0] * out_t[0].nbytes))


def _matmul_scratch(chunk: int) -> np.ndarray:
    """This thread's float32 scratch of at least `chunk` values, for W.T's columns."""
    have = getattr(_thread_scratch, "chunk", None)
    if have is None or have.size < chunk:
        _thread_scratch.chunk = have = np.empty(chunk, np.float32)
    return have


def tensor_to_float32(tensor: gguf.ReaderTensor) -> np.ndarray:
    """A small tensor (norm weight, bias) as an owned float32 array in numpy (reversed GGML) order."""
    qtype = _check_supported(tensor)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.array(gguf.quants.dequantize(tensor.data, qtype), dtype=np.float32).reshape(shape)


def _check_supported(tensor: gguf.ReaderTensor) -> QType:
    try:
        qtype = QType(tensor.tensor_type)
    except ValueError:
        qtype = None
    if qtype not in SUPPORTED:
        name = qtype.name if qtype is not None else f"#{int(tensor.tensor_type)}"
        raise InfernoError(f"tensor {tensor.name}: type {name} is not supported "
                           f"(supported: {', '.join(t.name for t in SUPPORTED)})")
    return qtype


def matrix_shape(tensor: gguf.ReaderTensor) -> tuple[QType, int, int]:
    """(block type, rows, cols) of a 2-D weight we can compute with."""
    qtype = _check_supported(tensor)
    dims = [int(n) for n in tensor.shape]
    if len(dims) != 2:
        raise InfernoError(f"tensor {tensor.name}: expected a 2-D weight, got shape {dims}")
    cols, rows = dims  # GGML order: ne0, the contiguous row length, first
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if cols % block:
        raise InfernoError(f"tensor {tensor.name}: row length {cols} is not a multiple of the "
                           f"{qtype.name} block size {block}")
    return qtype, rows, cols


def tile_lanes(qtype: QType, rows: list[int]) -> int:
    """Rows of a tile holding weights of `rows` rows each, stacked. For the packed types, the widest of
    PACKED_TILE_ROWS that still cuts them into MIN_TILES tiles or more, padded by at most 1/16: decode
    reads matrices of many rows faster in wide tiles, while a narrow matrix in few wide ones leaves
    threads idle and reads padding (docs/LOG.md has the figures)."""
    if int(qtype) not in PACKED:
        return TILE_ROWS
    total = sum(rows)
    for lanes in PACKED_TILE_ROWS[:-1]:
        tiles = sum(-(-n // lanes) for n in rows)
        if tiles >= MIN_TILES and 16 * (tiles * lanes - total) <= total:
            return lanes
    return PACKED_TILE_ROWS[-1]


def tile_layout(qtype: QType, rows: list[int], cols: int) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """The tiles' shape holding weights of `rows` rows each, stacked, and each one's (first row, rows)."""
    if qtype not in SUPPORTED:
        raise ValueError(f"block type {qtype!r} is not supported")
    lanes = tile_lanes(qtype, rows)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    type_size = TILE_BYTES.get(int(qtype), type_size)
    if cols < 1 or cols % block or min(rows, default=0) < 1:
        raise ValueError(f"{qtype.name} weights of {rows} rows of {cols} cannot be tiled")
    parts, first = [], 0
    for n in rows:
        parts.append((first * lanes, n))
        first += -(-n // lanes)
    return (first, cols // block, type_size, lanes), parts


# ---------------------------------------------------------------------------------------------------
# Fused tile dot products: acc[lane] += (row lane of the tile) . x, straight from the blocks. The packed
# types take integer dots (nibble_dots, `_dot_integer`); Q8_0 at float32 activations takes float dots,
# one block and 16 lanes a call (`_q8_0_block`).


@intrinsic
def _q8_0_block(typingctx, w, b, g, x, acc):
    """acc[g..g+15] += d * sum_j x[32 b + j] * q_j for lanes g..g+15 of block b of tile w (uint8[block,
    34, lane]: d's two bytes, then value j's int8 in row 2 + j), in SUMS sums side by side: as one
    chain, each of the 32 adds waited out the one before (the loop over the lanes that Numba compiled
    ran that way)."""
    if not all(isinstance(a, types.Array) and a.layout == "C" for a in (w, x, acc)) or w.ndim != 3:
        return None
    sig = types.void(w, b, g, x, acc)

    def codegen(context, builder, signature, args):
        w_v, b_v, g_v, x_v, acc_v = args
        w_t, _, _, x_t, acc_t = signature.args
        b_v = context.cast(builder, b_v, signature.args[1], types.intp)
        g_v = context.cast(builder, g_v, signature.args[2], types.intp)
        lanes = cgutils.unpack_tuple(builder, context.make_array(w_t)(context, builder, w_v).shape)[2]
        floats = ir.VectorType(ir.FloatType(), NIBBLE_LANES)
        first = builder.mul(b_v, builder.mul(lanes, ir.Constant(lanes.type, 34)))

        def row(r: int) -> ir.Value:  # lanes g..g+15 of byte row r, <16 x i8>
            at = builder.add(first, builder.add(builder.mul(lanes, ir.Constant(lanes.type, r)), g_v))
            vector = ir.VectorType(ir.IntType(8), NIBBLE_LANES)
            return builder.load(pointer(context, builder, w_t, w_v, at, vector), align=1)

        sums = [ir.Constant(floats, [0.0] * NIBBLE_LANES)] * SUMS
        for j in range(32):
            at = builder.add(builder.mul(b_v, ir.Constant(b_v.type, 32)), ir.Constant(b_v.type, j))
            value = builder.load(pointer(context, builder, x_t, x_v, at, ir.FloatType()))
            q = builder.sitofp(row(2 + j), floats)
            product = builder.fmul(splat(builder, value, NIBBLE_LANES), q)
            sums[j % SUMS] = builder.fadd(sums[j % SUMS], product)
        while len(sums) > 1:
            sums = [builder.fadd(sums[k], sums[k + 1]) for k in range(0, len(sums), 2)]
        d = halves_to_floats(builder, row(0), row(1))
        target = pointer(context, builder, acc_t, acc_v, g_v, floats)
        builder.store(builder.fadd(builder.load(target, align=4), builder.fmul(d, sums[0])), target, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, fastmath=True)
def _dot_q8_0(w, x, xs, acc, s):
    for b in range(w.shape[0]):
        prefetch_row(w, b + SPAN)  # as the integer dots ask: a span ahead, into L2 (2 KiB into L1 was slower)
        for g in range(0, acc.size, NIBBLE_LANES):
            _q8_0_block(w, b, g, x, acc)


@njit(cache=True, fastmath=False)  # said, or it inherits its callers': LLVM would regroup a span's sums
def _dot_integer(w, parts, scale, sums, acc, qtype, n_parts):
    """acc[i, lane] += row lane of tile w . x_i for each row i of x, from x_i's n_parts int8 parts, each
    block's scale and its sums (inferno.kernels.nibble_dots.quant_dots): parts [rows, n_parts, cols], scale
    and sums [rows, blocks]; qtype and n_parts compile-time constants."""
    per = K_SUB_BLOCKS if qtype in (Q4_K, Q5_K, Q6_K) else 1  # blocks of 32 values per block of the tile
    first = 0
    if parts.shape[0] == 1:  # one row: spans of SPAN blocks, each lane group's sums kept in a register
        first = scale.shape[1] - scale.shape[1] % SPAN
        for b in range(0, first, SPAN):
            for g in range(0, acc.shape[1], NIBBLE_LANES):
                quant_dots(w, b, g, parts, scale, sums, acc, qtype, n_parts, SPAN)
    for b in range(first, scale.shape[1]):  # blocks of 32 values, each unpacked once for every row
        if b % per == 0:  # a span ahead, as the spans ask: after a single row's last full span, the next
            prefetch_row(w, (b + SPAN) // per)  # tile's first span is then all in L2 (docs/LOG.md)
        for g in range(0, acc.shape[1], NIBBLE_LANES):
            quant_dots(w, b, g, parts, scale, sums, acc, qtype, n_parts, 1)


_DOT = {Q8_0: _dot_q8_0}
assert set(_DOT) | set(PACKED) == {int(t) for t in FUSED}


# ---------------------------------------------------------------------------------------------------
# Dispatch. The drivers below are built per type by `_matvec(qtype, n_parts)` and `_kernels(qtype)`, with
# `qtype` and `n_parts` closure constants: Numba sees them as literals, so these typing-time dispatchers
# pick one type's functions and only those get compiled. (Closures over plain ints are cached like
# module functions; closures over dispatchers would not be, hence the indirection.)


def _tile_dot(qtype, w, x, xq, acc, work, n_parts):
    """acc = tile w @ x (dispatch stub, resolved by the overload below). xq: what every tile uses of x
    (its block sums, or for Q8_0 in integers its part sums; with integer dots its int8 parts and block
    scales); work: one thread's scratch (float32[4, lanes], and for unfused types float32[cols,
    lanes]); n_parts: how many int8 parts x is split into (integer_parts; 0: float32)."""
    raise NotImplementedError


@overload(_tile_dot, prefer_literal=True)
def _tile_dot_impl(qtype, w, x, xq, acc, work, n_parts):
    if n_parts.literal_value:
        type_, count = qtype.literal_value, n_parts.literal_value

        def integer(qtype, w, x, xq, acc, work, n_parts):
            zero(acc)
            sums, parts, scale = xq
            _dot_integer(w, parts.reshape(1, parts.shape[0], parts.shape[1]), scale.reshape(1, scale.size),
                         sums.reshape(1, sums.size), acc.reshape(1, acc.size), type_, count)

        return integer
    if qtype.literal_value in _DOT:
        dot = _DOT[qtype.literal_value]

        def fused(qtype, w, x, xq, acc, work, n_parts):
            zero(acc)
            dot(w, x, xq[0], acc, work[0])

        return fused
    deq = DEQUANTIZE[qtype.literal_value]

    def dequantized(qtype, w, x, xq, acc, work, n_parts):
        scratch = work[1]
        deq(w, 0, acc.size, scratch, 0)
        zero(acc)
        for c in range(x.size):
            for r in range(acc.size):
                acc[r] += scratch[c, r] * x[c]

    return dequantized


@functools.cache
def _matvec(qtype: int, n_parts: int) -> Callable:
    """The matvec of one type, with x split into n_parts int8 parts (0: float32; see integer_parts)."""
    fused, integer = qtype in _DOT or n_parts > 0, n_parts > 0

    @njit(cache=True, parallel=True, fastmath=True)
    def matvec(tiles, x, out, nchunks):
        ntiles, lanes = tiles.shape[0], tiles.shape[3]
        nblocks = x.size // 32  # the float types' rows need not be whole blocks; they ignore xq
        xs = np.zeros(sums_size(qtype, nblocks), np.float32)
        parts = np.empty((n_parts, x.size if integer else 0), np.int8)
        scale = np.empty(nblocks if integer else 0, np.float32)
        if integer:
            integer_activations(x, parts, scale, xs, qtype)
        else:
            for b in range(nblocks):
                for j in range(32):
                    xs[b] += x[32 * b + j]
        nchunks = min(ntiles, nchunks)
        for c in prange(nchunks):  # one run of tiles per thread, so scratch is allocated once per thread
            acc = np.empty(lanes, np.float32)
            work = (np.empty((4, lanes), np.float32),
                    np.empty((0 if fused else x.size, lanes), np.float32))
            for t in range(c * ntiles // nchunks, (c + 1) * ntiles // nchunks):
                _tile_dot(qtype, tiles[t], x, (xs, parts, scale), acc, work, n_parts)
                for r in range(min(lanes, out.size - t * lanes)):
                    out[t * lanes + r] = acc[r]

    return matvec


class _Kernels(NamedTuple):
    dequantize_rows: Callable
    dequantize_transposed: Callable


@functools.cache
def _kernels(qtype: int) -> _Kernels:
    @njit(cache=True)
    def dequantize_rows(tiles, ids, out):
        """out[k] = row ids[k]; runs of consecutive ids within a tile are done together."""
        lanes = tiles.shape[3]
        scratch = np.empty((out.shape[1], lanes), np.float32)
        k = 0
        while k < ids.size:
            t, r = ids[k] // lanes, ids[k] % lanes
            n = 1
            while k + n < ids.size and ids[k + n] == ids[k] + n and r + n < lanes:
                n += 1
            dequantize_tile(qtype, tiles[t], r, r + n, scratch)
            for i in range(n):
                for c in range(out.shape[1]):
                    out[k + i, c] = scratch[c, i]
            k += n

    @njit(cache=True, nogil=True)
    def dequantize_transposed(tiles, out_t, span):
        """out_t[col, t * lanes + lane] = element col of row lane of tile t: whole tiles, W.T for BLAS,
        each tile written in place among the others' columns. `span` blocks of every tile at a time
        (`blocks_per_span`), so the rows of out_t written together stay in the core's cache: tile by
        tile over whole rows, the writes spread over the whole chunk."""
        ntiles, nblocks, _, lanes = tiles.shape
        per_block = out_t.shape[0] // nblocks  # values
        for b0 in range(0, nblocks, span):
            b1 = min(b0 + span, nblocks)
            rows = out_t[b0 * per_block : b1 * per_block]
            for t in range(ntiles):
                dequantize_tile(qtype, tiles[t, b0:b1], 0, lanes, rows, t * lanes)

    return _Kernels(dequantize_rows, dequantize_transposed)
