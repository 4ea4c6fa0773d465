"""A weight's blocks as the file holds them -> the tiles the kernels read (inferno.quant's Layout): each
row's blocks moved to a lane, and the packed types' values regrouped (inferno.nibble_dots.Packing);
`read_tiles` reads a tensor a window of the file at a time into a `TileStore`.

One pass in a parallel kernel over a chunk of rows read from the file: numpy's reshapes and stacks took
several temporary copies of every weight, most of the load time of a 1.5B model. Q4_K and Q6_K, most of a
Q4_K_M file, go a chunk of rows at a time (`_by_words`): their blocks' words side by side first, then each
byte row of the tile for all those rows in loops over lanes, which LLVM vectorizes; the other types a row
at a time (`_by_lane`)."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from numba import prange

from inferno.errors import InfernoError
from inferno.kernels.ggml import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K
from inferno.kernels.jit import njit
from inferno.kernels.llvm_ir import prefetch_row, shift_right
from inferno.kernels.nibble_dots import PACKED

# Repacked blocks are this many bytes (the others as many as the file's): Q4_K's and Q5_K's 6-bit
# scales and minimums take a byte each.
TILE_BYTES = {Q4_K: 148, Q5_K: 180}
LOAD_WINDOW_BYTES = 64 << 20  # file bytes mapped at a time while repacking
CHUNK = 64  # rows `_by_words` turns into a tile's lanes at a time (its words fit in L1)
_QS_Q4_0, _QS_Q4_1 = PACKED[Q4_0].quads, PACKED[Q4_1].quads
_PLANES_Q5_0, _PLANES_Q5_1 = PACKED[Q5_0].planes, PACKED[Q5_1].planes


def repack(raw: np.ndarray, tiles: np.ndarray, qtype: int) -> None:
    """raw uint8[rows, blocks, file bytes] -> tiles uint8[tile, block, tile bytes, lane]; lanes past
    the rows (the last tile's) are zeros."""
    (_by_words if qtype in (Q4_K, Q6_K) else _by_lane)(raw, tiles, qtype)


@njit(cache=True, parallel=True)
def _by_words(raw, tiles, qtype):
    """Q4_K, Q6_K: for each block of CHUNK rows, word i of every row's block at words[i, lane] (Q6_K's
    last two bytes, d, in `ends`), then the tile's byte rows from those, all the chunk's lanes at once."""
    ntiles, nblocks, _, lanes = tiles.shape
    nwords, chunk = raw.shape[2] // 4, min(lanes, CHUNK)
    tile_words = tiles.reshape(ntiles, nblocks, -1).view(np.uint32)
    for t in prange(ntiles):
        words, ends = np.empty((nwords, chunk), np.uint32), np.empty((2, chunk), np.uint8)
        for b in range(nblocks):
            for g in range(0, lanes, chunk):
                first = t * lanes + g
                n = max(0, min(chunk, raw.shape[0] - first))
                if n < chunk:
                    words[:] = 0
                    ends[:] = 0
                for lane in range(n):
                    prefetch_row(raw[first + lane], b + 2)  # the CPU misses these CHUNK streams
                    src = raw[first + lane, b]
                    w = src[: 4 * nwords].view(np.uint32)
                    for i in range(nwords):
                        words[i, lane] = w[i]
                    if qtype == Q6_K:
                        ends[0, lane], ends[1, lane] = src[208], src[209]
                if qtype == Q4_K:
                    _q4_k_rows(words, tiles[t, b], tile_words[t, b], g)
                else:
                    _q6_k_rows(words, ends, tiles[t, b], tile_words[t, b], g)


@njit(cache=True, parallel=True)
def _by_lane(raw, tiles, qtype):
    """The other types, a row's block at a time into its lane."""
    ntiles, nblocks, _, lanes = tiles.shape
    words = tiles.reshape(ntiles, nblocks, -1).view(np.uint32)  # each block's tiles as 4-byte words
    for t in prange(ntiles):
        for b in range(nblocks):
            dst = tiles[t, b]
            if (t + 1) * lanes > raw.shape[0]:
                dst[:] = 0  # (a lane's words spread over other lanes' columns: see _put)
            for lane in range(min(lanes, raw.shape[0] - t * lanes)):
                src = raw[t * lanes + lane, b]
                at = (lane * 4 // lanes, lane * 4 % lanes)  # where the lane's words start (see _put)
                if qtype in (Q4_0, Q4_1):
                    _q4(src, dst, lane, at, _QS_Q4_1 if qtype == Q4_1 else _QS_Q4_0)
                elif qtype in (Q5_0, Q5_1):
                    _q5(src, dst, lane, at, _PLANES_Q5_1 if qtype == Q5_1 else _PLANES_Q5_0)
                elif qtype == Q5_K:
                    _q5_k(src, dst, words[t, b], lane, at)
                else:
                    for p in range(src.size):
                        dst[p, lane] = src[p]


@njit(cache=True, inline="always")
def _put(dst, row, k, i, at, value):
    """Byte i of 4-byte word k of a lane, of the words starting at byte row `row`: the words sit side
    by side, [k, lane, 4] laid over the byte rows, so a lane's word k starts at row row + 4k + at[0],
    column at[1] (at = divmod(4 lane, lanes))."""
    dst[row + 4 * k + at[0], at[1] + i] = value


@njit(cache=True, inline="always")
def _quads(low, high):
    """Two sub-blocks of 32 values, four of each a word: the values of one are the low nibbles of the
    words `low` and `high` (its bytes 0-15 and 16-31), those of the other their high nibbles. Each as
    nibble quads (byte t holds values t and t + 16): (the first's word, the second's)."""
    return (np.uint32((low & 0x0F0F0F0F) | ((high & 0x0F0F0F0F) << 4)),
            np.uint32((shift_right(low, np.uint32(4)) & 0x0F0F0F0F) | (high & 0xF0F0F0F0)))


@njit(cache=True, inline="always")
def _k_scales(s0, s4, s8):
    """Q4_K's and Q5_K's scale and minimum bytes j, 4 + j, 8 + j, 12 + j from its packed 6-bit ones j,
    4 + j and 8 + j (bytes 4 + j.. of the block): scale j, minimum j, scale 4 + j, minimum 4 + j."""
    return (np.uint8(s0 & 63), np.uint8(s4 & 63), np.uint8((s8 & 15) | (shift_right(s0, np.uint32(6)) << 4)),
            np.uint8(shift_right(s8, np.uint32(4)) | (shift_right(s4, np.uint32(6)) << 4)))


@njit(cache=True)
def _q4(src, dst, lane, at, qs):
    """Q4_0 (qs = 2), Q4_1 (qs = 4): the scales as they are, the nibble bytes as quads."""
    for p in range(qs):
        dst[p, lane] = src[p]
    for t in range(16):
        _put(dst, qs, t // 4, t % 4, at, src[qs + t])


@njit(cache=True, inline="always")
def _fifth_bits(dst, row, at, src, first, per_byte, shift):
    """A sub-block's 5th bits as one plane word (byte i: bit m of value 4m + i, or 16 + 4(m - 4) + i),
    that of value v being bit shift + v % per_byte of src[first + v // per_byte] (Q5_0, Q5_1: eight
    values a byte; Q5_K: one, bit j for sub-block j)."""
    for i in range(4):
        plane = 0
        for m in range(8):
            v = 4 * m + i if m < 4 else 16 + 4 * (m - 4) + i
            plane |= ((src[first + v // per_byte] >> (shift + v % per_byte)) & 1) << m
        _put(dst, row, 0, i, at, np.uint8(plane))


@njit(cache=True)
def _q5(src, dst, lane, at, planes):
    """Q5_0 (planes = 2), Q5_1 (planes = 4): d (and m), then the 5th bits as one plane word, then the
    nibble quads; the file's qh sits where the plane goes, its qs where the quads go."""
    for p in range(planes):
        dst[p, lane] = src[p]
    _fifth_bits(dst, planes, at, src, planes, 8, 0)
    for t in range(16):
        _put(dst, planes + 4, t // 4, t % 4, at, src[planes + 4 + t])


@njit(cache=True)
def _q5_k(src, dst, words, lane, at):
    """d and dmin, the eight 6-bit scales (bytes 4-11) and minimums (12-19) a byte each, then each
    sub-block of 32 values (its nibbles after the 32 bytes of qh) as nibble quads and a plane word of
    its 5th bits (rows 20 + 20j, 36 + 20j). words: dst as uint32[-1]."""
    for p in range(4):
        dst[p, lane] = src[p]
    for j in range(4):
        dst[4 + j, lane], dst[12 + j, lane], dst[8 + j, lane], dst[16 + j, lane] = _k_scales(
            np.uint32(src[4 + j]), np.uint32(src[8 + j]), np.uint32(src[12 + j]))
    lanes, src_words = dst.shape[1], src.view(np.uint32)
    for c in range(4):  # sub-blocks 2c and 2c + 1 are the low and high nibbles of bytes 32c.. of qs
        for k in range(4):
            even, odd = _quads(src_words[12 + 8 * c + k], src_words[16 + 8 * c + k])
            words[(20 + 40 * c) * lanes // 4 + k * lanes + lane] = even
            words[(40 + 40 * c) * lanes // 4 + k * lanes + lane] = odd
        _fifth_bits(dst, 36 + 40 * c, at, src, 16, 1, 2 * c)  # bit j of qh[v] (bytes 16-47): value v of
        _fifth_bits(dst, 56 + 40 * c, at, src, 16, 1, 2 * c + 1)  # sub-block j's 5th bit


@njit(cache=True, inline="always")
def _quad_rows(words, dst_words, lanes, g, even_row, odd_row, first):
    """For lanes g.. (as many as `words` holds): _quads of words[first + k] and words[first + 4 + k],
    word k of byte rows even_row and odd_row of the tile (dst_words: its bytes as uint32[-1])."""
    n = words.shape[1]
    for k in range(4):
        low, high = words[first + k], words[first + 4 + k]
        at_even, at_odd = even_row * lanes // 4 + k * lanes + g, odd_row * lanes // 4 + k * lanes + g
        even, odd = dst_words[at_even : at_even + n], dst_words[at_odd : at_odd + n]
        for lane in range(n):
            even[lane], odd[lane] = _quads(low[lane], high[lane])


@njit(cache=True)
def _q4_k_rows(words, dst, dst_words, g):
    """Q4_K for lanes g.. of a tile's block dst [tile bytes, lanes] (laid out as _q5_k's, without the
    5th bits: sub-blocks at rows 20 + 16j) from words[i, lane] (word i of each row's block)."""
    n, lanes = words.shape[1], dst.shape[1]
    for p in range(4):  # d and dmin
        row, shift = dst[p, g : g + n], np.uint32(8 * p)
        for lane in range(n):
            row[lane] = np.uint8(shift_right(words[0, lane], shift) & 255)
    for j in range(4):
        shift = np.uint32(8 * j)
        scale, low_min, high_scale, high_min = (dst[4 + j, g : g + n], dst[12 + j, g : g + n],
                                                dst[8 + j, g : g + n], dst[16 + j, g : g + n])
        for lane in range(n):
            scale[lane], low_min[lane], high_scale[lane], high_min[lane] = _k_scales(
                np.uint32(shift_right(words[1, lane], shift) & 255),
                np.uint32(shift_right(words[2, lane], shift) & 255),
                np.uint32(shift_right(words[3, lane], shift) & 255))
    for c in range(4):  # sub-blocks 2c and 2c + 1: the nibbles of words 4 + 8c..
        _quad_rows(words, dst_words, lanes, g, 20 + 32 * c, 36 + 32 * c, 4 + 8 * c)


@njit(cache=True)
def _q6_k_rows(words, ends, dst, dst_words, g):
    """Q6_K for lanes g.. of a tile's block dst [tile bytes, lanes]: d (ends), the 16 int8 scales, then
    each sub-block of 32 values (j = 4h + s: values 128h + 32s..) as nibble quads and two plane words of
    its high 2 bits (rows 18 + 24j, 34 + 24j), from words[i, lane] (word i of each row's block)."""
    n, lanes = words.shape[1], dst.shape[1]
    for p in range(2):
        row = dst[p, g : g + n]
        for lane in range(n):
            row[lane] = ends[p, lane]
    for p in range(16):  # the scales: bytes 192.. (words 48..)
        row, shift = dst[2 + p, g : g + n], np.uint32(8 * (p % 4))
        for lane in range(n):
            row[lane] = np.uint8(shift_right(words[48 + p // 4, lane], shift) & 255)
    for h in range(2):  # low 4 bits: sub-blocks 4h + r and 4h + r + 2 are the nibbles of ql bytes 64h + 32r..
        for r in range(2):
            j = 4 * h + r
            _quad_rows(words, dst_words, lanes, g, 18 + 24 * j, 18 + 24 * (j + 2), 16 * h + 8 * r)
    for j in range(8):  # high 2 bits: bits 2s of qh bytes 128 + 32h + v; byte i of word p of a plane
        h, shift = j // 4, np.uint32(2 * (j % 4))  # holds those of its bytes 4(4p + k) + i, in bits 2k
        for p in range(2):
            at, first = (34 + 24 * j) * lanes // 4 + p * lanes + g, 32 + 8 * h + 4 * p
            plane = dst_words[at : at + n]
            for lane in range(n):
                plane[lane] = np.uint32(
                    (shift_right(words[first, lane], shift) & 0x03030303)
                    | ((shift_right(words[first + 1, lane], shift) & 0x03030303) << 2)
                    | ((shift_right(words[first + 2, lane], shift) & 0x03030303) << 4)
                    | ((shift_right(words[first + 3, lane], shift) & 0x03030303) << 6))


class TileStore:
    """Where matrices' tiles are built: here, in memory. The prepared-model cache's writer builds them
    in its file instead (inferno.model.prepared), which is why tiles are written through `writing`."""

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        """An uninitialized uint8 array of `shape`, for a matrix's tiles."""
        return np.empty(shape, np.uint8)

    @contextlib.contextmanager
    def writing(self, tiles: np.ndarray) -> Iterator[np.ndarray]:
        """Where to build `tiles` (a run of tiles of an array `empty` gave): the array itself, here."""
        yield tiles


IN_MEMORY = TileStore()


def read_tiles(tensor: gguf.ReaderTensor, rows: int, tiles: np.ndarray, store: TileStore) -> None:
    """Fill tiles uint8[tiles, blocks, type_size, lanes] (through `store`) with the tensor's blocks,
    zero rows padding the last tile."""
    ntiles, nblocks, _, lanes = tiles.shape
    qtype = int(tensor.tensor_type)
    type_size = gguf.GGML_QUANT_SIZES[QType(qtype)][1]  # the file's
    row_bytes = nblocks * type_size
    step = max(1, LOAD_WINDOW_BYTES // (lanes * row_bytes))  # tiles per window
    for t in range(0, ntiles, step):
        n = min(step, ntiles - t)
        count = min(n * lanes, rows - t * lanes)
        with _tensor_bytes(tensor, t * lanes * row_bytes, count * row_bytes) as raw, \
                store.writing(tiles[t : t + n]) as out:
            repack(raw.reshape(count, nblocks, type_size), out, qtype)


@contextlib.contextmanager
def _tensor_bytes(tensor: gguf.ReaderTensor, start: int, length: int) -> Iterator[np.ndarray]:
    """uint8[length]: the tensor's bytes from `start`. From the file, through a mapping of just these
    bytes whose pages are dropped afterwards: pages touched in the reader's own map would stay resident
    next to the repacked copy, doubling the model's memory, and read() into a buffer copies every byte
    once more. A tensor not in a file (a reader over bytes) gives a view of its array."""
    place = mapped_file(tensor)
    if place is None:
        yield np.ascontiguousarray(tensor.data).view(np.uint8).reshape(-1)[start : start + length]
        return
    at = place[1] + start
    page = at - at % mmap.ALLOCATIONGRANULARITY
    with open(place[0], "rb") as f:
        if os.fstat(f.fileno()).st_size < at + length:
            raise InfernoError(f"tensor {tensor.name}: file ends inside the tensor's data")
        window = mmap.mmap(f.fileno(), at + length - page, access=mmap.ACCESS_READ, offset=page)
    try:
        yield np.frombuffer(window, np.uint8, length, at - page)
    finally:
        window.madvise(mmap.MADV_DONTNEED)  # out of this process's memory (the page cache keeps them)


def mapped_file(tensor: gguf.ReaderTensor) -> tuple[str, int] | None:
    """(the file, the byte where the tensor's data starts in it) for a tensor read from a file through
    gguf's memory map; None for a reader over bytes."""
    array = tensor.data
    while isinstance(array, np.ndarray) and not (isinstance(array, np.memmap) and array.filename):
        array = array.base
    return (array.filename, int(tensor.data_offset)) if isinstance(array, np.memmap) else None
