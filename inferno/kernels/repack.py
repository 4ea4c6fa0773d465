"""A weight's blocks as the file holds them -> the tiles the kernels read (inferno.quant's Layout): each
row's blocks moved to a lane, and the packed types' values regrouped (inferno.nibble_dots.Packing);
`read_tiles` reads a tensor a window of the file at a time into a `TileStore`.

One pass in a parallel kernel over a chunk of rows read from the file: numpy's reshapes and stacks took
several temporary copies of every weight, most of the load time of a 1.5B model. The block types go a
chunk of rows at a time (`_by_words`): their blocks' 4-byte words side by side first, then each byte row
of the tile for all those rows, in loops over lanes that LLVM vectorizes; the float types a row at a
time (`_by_lane`)."""

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
from inferno.kernels.ggml import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from inferno.kernels.jit import njit
from inferno.kernels.llvm_ir import prefetch_row, shift_right, word_at

# Repacked blocks are this many bytes (the others as many as the file's): Q4_K's and Q5_K's 6-bit
# scales and minimums take a byte each.
TILE_BYTES = {Q4_K: 148, Q5_K: 180}
LOAD_WINDOW_BYTES = 64 << 20  # file bytes mapped at a time while repacking
CHUNK = 64  # rows `_by_words` turns into a tile's lanes at a time (its words fit in L1)


def repack(raw: np.ndarray, tiles: np.ndarray, qtype: int) -> None:
    """raw uint8[rows, blocks, file bytes] -> tiles uint8[tile, block, tile bytes, lane]; lanes past
    the rows (the last tile's) are zeros."""
    ntiles, nblocks, tile_bytes, lanes = tiles.shape
    # the kernels' loads and stores are unchecked: the shapes must agree
    if raw.ndim != 3 or raw.shape[1] != nblocks or raw.shape[0] > ntiles * lanes or \
            tile_bytes != TILE_BYTES.get(qtype, raw.shape[2]) or lanes % min(lanes, CHUNK):
        raise ValueError(f"blocks {raw.shape} of type {qtype} do not fit tiles {tiles.shape}")
    if qtype in _WORDS:
        skip, nwords, end = _WORDS[qtype]
        if raw.shape[2] != gguf.GGML_QUANT_SIZES[QType(qtype)][1]:
            raise ValueError(f"blocks of type {qtype} cannot be {raw.shape[2]} bytes")
        _by_words(np.ascontiguousarray(raw), tiles, qtype, skip, nwords, end)
    else:
        _by_lane(raw, tiles)


# A block as `_by_words` reads it: (the byte its 4-byte words start at, how many, the first of the two
# bytes outside them or -1): f16 scales before 4-byte fields, or Q6_K's d after them.
_WORDS = {Q8_0: (2, 8, 0), Q4_0: (2, 4, 0), Q4_1: (0, 5, -1), Q5_0: (2, 5, 0), Q5_1: (0, 6, -1),
          Q4_K: (0, 36, -1), Q5_K: (0, 44, -1), Q6_K: (0, 52, 208)}


@njit(cache=True, parallel=True)
def _by_words(raw, tiles, qtype, skip, nwords, end):
    """For each block of CHUNK rows: word i of every row's block at words[i, lane] (the two bytes from
    `end` in `ends`), then the tile's byte rows from those, all the chunk's lanes at once (loops over
    lanes, which LLVM vectorizes; a row at a time, the stores a tile's width apart, it could not)."""
    ntiles, nblocks, _, lanes = tiles.shape
    chunk, type_size = min(lanes, CHUNK), raw.shape[2]
    tile_words = tiles.reshape(ntiles, nblocks, -1).view(np.uint32)
    data = raw.reshape(-1)
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
                    at = ((first + lane) * nblocks + b) * type_size
                    for i in range(nwords):
                        words[i, lane] = word_at(data, at + skip + 4 * i)
                    if end >= 0:
                        ends[0, lane], ends[1, lane] = data[at + end], data[at + end + 1]
                _tile_rows(words, ends, tiles[t, b], tile_words[t, b], g, qtype)


@njit(cache=True, parallel=True)
def _by_lane(raw, tiles):
    """The float types: a row's values into its lane, byte for byte."""
    ntiles, nblocks, _, lanes = tiles.shape
    for t in prange(ntiles):
        for b in range(nblocks):
            dst = tiles[t, b]
            if (t + 1) * lanes > raw.shape[0]:
                dst[:] = 0
            for lane in range(min(lanes, raw.shape[0] - t * lanes)):
                src = raw[t * lanes + lane, b]
                for p in range(src.size):
                    dst[p, lane] = src[p]


@njit(cache=True)
def _tile_rows(words, ends, dst, dst_words, g, qtype):
    """Lanes g.. of a tile's block dst [tile bytes, lanes] (dst_words: its bytes as uint32[-1]) from
    words[i, lane] and ends (see _by_words): scales a byte row each, the packed types' values as nibble
    quads in words over four byte rows ([k, lane, 4]: `_word_rows`), their 5th and high bits as plane
    words (nibble_dots.Packing has each layout)."""
    lanes, fifth = dst.shape[1], qtype in (Q5_0, Q5_1, Q5_K)
    if qtype == Q8_0:  # d, then value j's int8 at row 2 + j
        _end_rows(ends, dst, 0, g)
        for i in range(8):
            _byte_rows(words[i], dst, 2 + 4 * i, g)
    elif qtype in (Q4_0, Q5_0):  # d, (the 5th bits' plane,) the nibble quads
        _end_rows(ends, dst, 0, g)
        if fifth:
            _plane_row(_fifth_plane, words, 0, 0, dst_words, lanes, 2, g)
        _word_rows(words, int(fifth), 4, dst_words, lanes, 2 + 4 * fifth, g)
    elif qtype in (Q4_1, Q5_1):  # d and m, (the 5th bits' plane,) the nibble quads
        _byte_rows(words[0], dst, 0, g)
        if fifth:
            _plane_row(_fifth_plane, words, 1, 0, dst_words, lanes, 4, g)
        _word_rows(words, 1 + fifth, 4, dst_words, lanes, 4 + 4 * fifth, g)
    elif qtype in (Q4_K, Q5_K):
        _k_rows(words, dst, dst_words, lanes, g, fifth)
    else:
        _q6_k_rows(words, ends, dst, dst_words, lanes, g)


@njit(cache=True, inline="always")
def _end_rows(ends, dst, row, g):
    """The two bytes outside a block's words, at byte rows row and row + 1."""
    n = ends.shape[1]
    for p in range(2):
        out = dst[row + p, g : g + n]
        for lane in range(n):
            out[lane] = ends[p, lane]


@njit(cache=True, inline="always")
def _byte_rows(word, dst, row, g):
    """Byte p of each lane's `word` at byte row row + p."""
    n = word.size
    for p in range(4):
        out, shift = dst[row + p, g : g + n], np.uint32(8 * p)
        for lane in range(n):
            out[lane] = np.uint8(shift_right(word[lane], shift) & 255)


@njit(cache=True, inline="always")
def _word_rows(words, first, count, dst_words, lanes, row, g):
    """words[first + k] as word k of the words from byte row `row` ([k, lane, 4] over the rows)."""
    n = words.shape[1]
    for k in range(count):
        at = row * lanes // 4 + k * lanes + g
        out = dst_words[at : at + n]
        for lane in range(n):
            out[lane] = words[first + k, lane]


@njit(cache=True, inline="always")
def _plane_row(plane, words, first, j, dst_words, lanes, row, g):
    """plane(words, first, j, lane) for each lane: the plane word from byte row `row`."""
    n = words.shape[1]
    at = row * lanes // 4 + g
    out = dst_words[at : at + n]
    for lane in range(n):
        out[lane] = plane(words, first, j, lane)


@njit(cache=True, inline="always")
def _fifth_plane(words, first, j, lane):
    """Q5_0's and Q5_1's 5th bits, bit v of words[first] that of value v, as a plane word: byte i bit m
    is value 4m + i's (values 4m + i are nibble quad i's, the low nibbles of its bytes m < 4)."""
    qh, plane = words[first, lane], np.uint32(0)
    for m in range(8):
        for i in range(4):
            plane |= np.uint32((shift_right(qh, np.uint32(4 * m + i)) & 1) << (8 * i + m))
    return plane


@njit(cache=True, inline="always")
def _k_fifth_plane(words, first, j, lane):
    """Q5_K's 5th bits of sub-block j, bit j of qh byte v (words first.., a byte a value) that of value
    v, as _fifth_plane lays them: byte i bit m from byte i of word first + m."""
    plane = np.uint32(0)
    for m in range(8):
        plane |= np.uint32((shift_right(words[first + m, lane], np.uint32(j)) & 0x01010101) << m)
    return plane


@njit(cache=True, inline="always")
def _quads(low, high):
    """Two sub-blocks of 32 values, four of each a word: the values of one are the low nibbles of the
    words `low` and `high` (its bytes 0-15 and 16-31), those of the other their high nibbles. Each as
    nibble quads (byte t holds values t and t + 16): (the first's word, the second's)."""
    return (np.uint32((low & 0x0F0F0F0F) | ((high & 0x0F0F0F0F) << 4)),
            np.uint32((shift_right(low, np.uint32(4)) & 0x0F0F0F0F) | (high & 0xF0F0F0F0)))


@njit(cache=True, inline="always")
def _quad_rows(words, dst_words, lanes, g, even_row, odd_row, first):
    """_quads of words[first + k] and words[first + 4 + k] for each lane: word k of the words from byte
    rows even_row and odd_row."""
    n = words.shape[1]
    for k in range(4):
        low, high = words[first + k], words[first + 4 + k]
        at_even, at_odd = even_row * lanes // 4 + k * lanes + g, odd_row * lanes // 4 + k * lanes + g
        even, odd = dst_words[at_even : at_even + n], dst_words[at_odd : at_odd + n]
        for lane in range(n):
            even[lane], odd[lane] = _quads(low[lane], high[lane])


@njit(cache=True)
def _k_rows(words, dst, dst_words, lanes, g, fifth):
    """Q4_K, and with `fifth` Q5_K: d and dmin, the eight 6-bit scales (bytes 4-11) and minimums (12-19)
    a byte each, then each sub-block of 32 values as nibble quads (Q4_K: rows 20 + 16j), and for Q5_K
    (its nibbles after the 32 bytes of qh) as nibble quads and a plane word of its 5th bits (rows
    20 + 20j, 36 + 20j)."""
    n = words.shape[1]
    _byte_rows(words[0], dst, 0, g)
    for j in range(4):  # scale and minimum j from packed bytes 4 + j and 8 + j, j + 4 from those and 12 + j
        shift = np.uint32(8 * j)
        scale, low_min, high_scale, high_min = (dst[4 + j, g : g + n], dst[12 + j, g : g + n],
                                                dst[8 + j, g : g + n], dst[16 + j, g : g + n])
        for lane in range(n):
            s0 = np.uint32(shift_right(words[1, lane], shift) & 255)
            s4 = np.uint32(shift_right(words[2, lane], shift) & 255)
            s8 = np.uint32(shift_right(words[3, lane], shift) & 255)
            scale[lane], low_min[lane] = np.uint8(s0 & 63), np.uint8(s4 & 63)
            high_scale[lane] = np.uint8((s8 & 15) | (shift_right(s0, np.uint32(6)) << 4))
            high_min[lane] = np.uint8(shift_right(s8, np.uint32(4)) | (shift_right(s4, np.uint32(6)) << 4))
    for c in range(4):  # sub-blocks 2c and 2c + 1: the low and high nibbles of qs bytes 32c..
        if fifth:  # qs after qh (words 4-11)
            _quad_rows(words, dst_words, lanes, g, 20 + 40 * c, 40 + 40 * c, 12 + 8 * c)
            _plane_row(_k_fifth_plane, words, 4, 2 * c, dst_words, lanes, 36 + 40 * c, g)
            _plane_row(_k_fifth_plane, words, 4, 2 * c + 1, dst_words, lanes, 56 + 40 * c, g)
        else:
            _quad_rows(words, dst_words, lanes, g, 20 + 32 * c, 36 + 32 * c, 4 + 8 * c)


@njit(cache=True)
def _q6_k_rows(words, ends, dst, dst_words, lanes, g):
    """Q6_K: d (ends), the 16 int8 scales, then each sub-block of 32 values (j = 4h + s: values
    128h + 32s..) as nibble quads and two plane words of its high 2 bits (rows 18 + 24j, 34 + 24j)."""
    _end_rows(ends, dst, 0, g)
    for i in range(4):  # the scales: bytes 192.. (words 48..)
        _byte_rows(words[48 + i], dst, 2 + 4 * i, g)
    for h in range(2):  # low 4 bits: sub-blocks 4h + r and 4h + r + 2 are the nibbles of ql bytes 64h + 32r..
        for r in range(2):
            j = 4 * h + r
            _quad_rows(words, dst_words, lanes, g, 18 + 24 * j, 18 + 24 * (j + 2), 16 * h + 8 * r)
    for j in range(8):  # high 2 bits: bits 2s of qh bytes 128 + 32h + v, two plane words a sub-block
        for p in range(2):
            _plane_row(_high_plane, words, 32 + 8 * (j // 4) + 4 * p, 2 * (j % 4), dst_words, lanes,
                       34 + 24 * j + 4 * p, g)


@njit(cache=True, inline="always")
def _high_plane(words, first, shift, lane):
    """Q6_K's high 2 bits from bit `shift` of each byte of words first..first + 3: byte i of the plane
    word holds those of byte i of word first + k in its bits 2k."""
    plane = np.uint32(0)
    for k in range(4):
        plane |= np.uint32((shift_right(words[first + k, lane], np.uint32(shift)) & 0x03030303) << (2 * k))
    return plane


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
