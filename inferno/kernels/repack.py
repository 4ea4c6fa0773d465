"""A weight's blocks as the file holds them -> the tiles the kernels read (inferno.quant's Layout): each
row's blocks moved to a lane, and the packed types' values regrouped (inferno.nibble_dots.Packing);
`read_tiles` reads a tensor a window of the file at a time into a `TileStore`.

One pass in a parallel kernel over a chunk of rows read from the file: numpy's reshapes and stacks took
several temporary copies of every weight, most of the load time of a 1.5B model."""

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
from inferno.kernels.nibble_dots import PACKED

# Repacked blocks are this many bytes (the others as many as the file's): Q4_K's and Q5_K's 6-bit
# scales and minimums take a byte each.
TILE_BYTES = {Q4_K: 148, Q5_K: 180}
LOAD_WINDOW_BYTES = 64 << 20  # file bytes mapped at a time while repacking
_QS_Q4_0, _QS_Q4_1 = PACKED[Q4_0].quads, PACKED[Q4_1].quads
_PLANES_Q5_0, _PLANES_Q5_1 = PACKED[Q5_0].planes, PACKED[Q5_1].planes


@njit(cache=True, parallel=True)
def repack(raw, tiles, qtype):
    """raw uint8[rows, blocks, file bytes] -> tiles uint8[tile, block, tile bytes, lane]; lanes past
    the rows (the last tile's) are zeros."""
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
                elif qtype in (Q4_K, Q5_K):
                    _q4_k(src, dst, words[t, b], lane, at, qtype == Q5_K)
                elif qtype == Q6_K:
                    _q6_k(src, dst, words[t, b], lane)
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
def _nibble_quad_pair(words, lanes, lane, even_row, odd_row, src_words, first):
    """Two sub-blocks of 32 values a word at a time: the values of one are the low nibbles of the 32
    bytes in src_words[first:first + 8], those of the other the high nibbles; each is written at its byte
    row as nibble quads (byte t holds values t and t + 16). words: the block's tiles [tile bytes, lanes]
    as uint32 [-1]."""
    for k in range(4):
        low, high = src_words[first + k], src_words[first + 4 + k]
        words[even_row * lanes // 4 + k * lanes + lane] = (low & 0x0F0F0F0F) | ((high & 0x0F0F0F0F) << 4)
        words[odd_row * lanes // 4 + k * lanes + lane] = ((low >> 4) & 0x0F0F0F0F) | (high & 0xF0F0F0F0)


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
def _q4_k(src, dst, words, lane, at, fifth):
    """d and dmin, the eight 6-bit scales (bytes 4-11) and minimums (12-19) a byte each, then each
    sub-block of 32 values as nibble quads (Q4_K: rows 20 + 16j), and with `fifth` (Q5_K, its nibbles
    after the 32 bytes of qh) as nibble quads and a plane word of its 5th bits (rows 20 + 20j, 36 + 20j)."""
    for p in range(4):
        dst[p, lane] = src[p]
    s = src[4:16]
    for j in range(4):
        dst[4 + j, lane] = s[j] & 63
        dst[12 + j, lane] = s[4 + j] & 63
        dst[8 + j, lane] = (s[8 + j] & 15) | ((s[j] >> 6) << 4)
        dst[16 + j, lane] = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4)
    lanes, src_words = dst.shape[1], src.view(np.uint32)
    for c in range(4):  # sub-blocks 2c and 2c + 1 are the low and high nibbles of bytes 32c.. of qs
        if fifth:  # bit j of qh[v] (bytes 16-47) is the 5th bit of value v of sub-block j
            _nibble_quad_pair(words, lanes, lane, 20 + 40 * c, 40 + 40 * c, src_words, 12 + 8 * c)
            _fifth_bits(dst, 36 + 40 * c, at, src, 16, 1, 2 * c)
            _fifth_bits(dst, 56 + 40 * c, at, src, 16, 1, 2 * c + 1)
        else:
            _nibble_quad_pair(words, lanes, lane, 20 + 32 * c, 36 + 32 * c, src_words, 4 + 8 * c)


@njit(cache=True)
def _q6_k(src, dst, words, lane):
    """d, the 16 int8 scales, then each sub-block of 32 values (j = 4h + s: values 128h + 32s..) as
    nibble quads and two plane words of its high 2 bits (rows 18 + 24j, 34 + 24j)."""
    dst[0, lane], dst[1, lane] = src[208], src[209]
    for p in range(16):
        dst[2 + p, lane] = src[192 + p]
    lanes, src_words = dst.shape[1], src[:208].view(np.uint32)
    for h in range(2):  # low 4 bits: sub-blocks 4h + r and 4h + r + 2 are the nibbles of ql bytes 64h + 32r..
        for r in range(2):
            j = 4 * h + r
            _nibble_quad_pair(words, lanes, lane, 18 + 24 * j, 18 + 24 * (j + 2), src_words, 16 * h + 8 * r)
    for j in range(8):  # high 2 bits: bits 2s of qh bytes 128 + 32h + v, byte i of word k of a plane
        h, s = j // 4, j % 4  # holding those of its bytes 4k + i, in bits 2k (all four bytes at once)
        for p in range(2):
            plane = 0
            for k in range(4):
                plane |= ((src_words[32 + 8 * h + 4 * p + k] >> (2 * s)) & 0x03030303) << (2 * k)
            words[(34 + 24 * j) * lanes // 4 + p * lanes + lane] = plane


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
