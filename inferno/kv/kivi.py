"""q4_kivi: keys quantized per channel, values per token, as KIVI (Liu et al., 2024) does.

A key's channels differ by orders of magnitude and drift slowly with position, so a scale per
channel over a group of positions fits them far better than a scale per position across channels
(llama.cpp's q4_0), whose largest channel sets the step for all. Keys are rounded to 4 bits per
channel over groups of GROUP positions, asymmetrically (an f16 scale and minimum per channel and
group: 4.5 bits a value); values per position as q4_0 blocks of Hadamard-rotated heads (4.5 bits).
A group is rounded when its last position is written; until then its rows wait in f16 (the open
group, at most GROUP rows per layer), so the newest positions, which attention leans on most,
are the most exact.

Attention reads the groups directly: a key group's scores are sum_c q_c (m_c + d_c n_cs) =
sum_c q_c m_c + sum_c (q_c d_c) n_cs, a vectorized pass over the group's 4-bit codes per channel.

Where rows live is the layout's: a group's key record is cut into one piece per position (`key_row_bytes`),
so key and value rows sit wherever a layout keeps a position's rows, found through a block table as
`blocks.attend_tables` finds them (prealloc: one block; paged: the pool's blocks; window: a ring of
blocks, `KiviRing`). The open group is the sequence's own (`KiviState`). A query over a sliding window
leaves out the positions of its first group that fall before the window; a window cache's sinks, kept
in f16 as the open group is, are one more span, scored with a query of their own.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from inferno.kernels.attention import attend_span, combine_spans, softmax_span
from inferno.kernels.jit import njit
from inferno.kv.blocks import (
    FMT_F16,
    FMT_Q4_0,
    decode_rows,
    encode_rows,
    float_to_half,
    hadamard_rows,
    half_at,
    half_to_float,
    mix_rows_at,
)
from inferno.kv.geometry import KVGeometry
from inferno.kv.memory import lazy_zeros
from inferno.kv.sinks import RingSinks

GROUP = 64  # positions per key group
UNBOUNDED = 2**62  # the capacity of a window's state, which runs past any: it closes every group
HALF = GROUP // 2  # a code byte holds position t (low nibble) and t + HALF (high)
VALUE_ROW_BLOCK = (32, 18)  # q4_0: values per block, bytes per block


def value_row_bytes(geometry: KVGeometry) -> int:
    return geometry.kv_width // VALUE_ROW_BLOCK[0] * VALUE_ROW_BLOCK[1]


def key_row_bytes(geometry: KVGeometry) -> int:
    """A group's key record (codes [w, HALF], then the f16 scale [w] and minimum [w] of each channel) is
    GROUP key rows of this many bytes: position p's row is the p % GROUP-th piece of its group's record, so
    a layout stores key rows where it stores any row (a paged pool's blocks) and a group is its rows read
    in order. w is a multiple of 32 (q4_0 values), so the record divides into GROUP rows."""
    return geometry.kv_width * (HALF + 4) // GROUP


def planned_nbytes(geometry: KVGeometry, capacity: int) -> int:
    """Bytes of a q4_kivi store for `capacity` tokens: every whole group, and the open group in f16."""
    groups = capacity // GROUP
    per_group = GROUP * (key_row_bytes(geometry) + value_row_bytes(geometry))  # key record; values
    return geometry.layers * groups * per_group + sequence_nbytes(geometry)


def sequence_nbytes(geometry: KVGeometry) -> int:
    """Bytes of the open group a sequence keeps in f16 besides its rows (`KiviState`)."""
    return geometry.layers * 2 * GROUP * geometry.kv_width * 2


@njit(cache=True)
def row_of(table: np.ndarray, block_size: int, p: int) -> int:
    """The row of position p: row table[p // block_size] * block_size + p % block_size of the rows
    (prealloc: one block holding them all; paged: the pool's blocks, blocks.attend_tables' addressing).
    A table shorter than the positions is a ring of blocks (a window cache's): its index wraps."""
    index = p // block_size
    slot = index if index < table.shape[0] else index % table.shape[0]
    return np.int64(table[slot]) * block_size + p - index * block_size


def rows_of(table: np.ndarray, block_size: int, p0: int, p1: int) -> np.ndarray:
    """row_of of every position p0 .. p1 - 1 (int64)."""
    positions = np.arange(p0, p1)
    index = positions // block_size
    return table[index % len(table)].astype(np.int64) * block_size + positions - index * block_size


def ring_blocks(window: int, sinks: int) -> int:
    """Blocks of GROUP positions in a window cache's ring (`KiviRing`): every position until the window
    slides (sinks + window), and after, what a query sees while a prefill piece, which ends at the end of
    its group at the latest, closes that group over the oldest block (window.py)."""
    return max(-(-(sinks + window) // GROUP), 1 + -(-(window - 1) // GROUP))


def ring_nbytes(geometry: KVGeometry, window: int, sinks: int) -> int:
    """Bytes of a KiviRing: its blocks, the open group and the sinks in f16."""
    rows = ring_blocks(window, sinks) * GROUP * (key_row_bytes(geometry) + value_row_bytes(geometry))
    return geometry.layers * (rows + 2 * sinks * geometry.kv_width * 2) + sequence_nbytes(geometry)


def record_parts(record: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes [w, HALF], scales [w] and mins [w] (f16 bits) of a group's key record [GROUP * key row]."""
    codes = record[: width * HALF].reshape(width, HALF)
    scales = record[width * HALF : width * (HALF + 2)].view(np.uint16)
    return codes, scales, record[width * (HALF + 2) :].view(np.uint16)


@njit(cache=True, fastmath=True)
def encode_channels(rows: np.ndarray, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray) -> None:
    """A group's key rows [GROUP, w] rounded per channel: codes [w, HALF], f16 bits of each channel's
    scale and minimum [w]."""
    for c in range(rows.shape[1]):
        lo = rows[0, c]
        hi = rows[0, c]
        for t in range(1, GROUP):
            lo = min(lo, rows[t, c])
            hi = max(hi, rows[t, c])
        mins[c] = float_to_half(lo)
        m = half_to_float(mins[c])
        scales[c] = float_to_half((hi - m) / np.float32(15.0))
        d = half_to_float(scales[c])
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        for t in range(HALF):
            a = min(15, max(0, int((rows[t, c] - m) * inv + np.float32(0.5))))
            b = min(15, max(0, int((rows[t + HALF, c] - m) * inv + np.float32(0.5))))
            codes[c, t] = np.uint8(a | (b << 4))


@njit(cache=True, fastmath=True)
def decode_channels(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, out: np.ndarray) -> None:
    """encode_channels' group back to float32 rows out [GROUP, w]."""
    for c in range(codes.shape[0]):
        d = half_to_float(scales[c])
        m = half_to_float(mins[c])
        for t in range(HALF):
            byte = codes[c, t]
            out[t, c] = m + d * np.float32(byte & 0xF)
            out[t + HALF, c] = m + d * np.float32(byte >> 4)




@njit(cache=True)
def _gather_record(key_rows: np.ndarray, table: np.ndarray, block_size: int, group: int,
                   out: np.ndarray) -> None:
    """Group `group`'s GROUP key rows, one contiguous run per block, into out [GROUP, key row]."""
    done = 0
    while done < GROUP:
        p = group * GROUP + done
        n = min(block_size - p % block_size, GROUP - done)
        r = row_of(table, block_size, p)
        out[done : done + n] = key_rows[r : r + n]
        done += n


@njit(cache=True, fastmath=True, parallel=True)
def attention_kivi(q: np.ndarray, key_rows: np.ndarray, values: np.ndarray, table: np.ndarray,
                   block_size: int, start: int, closed: int, open_keys: np.ndarray, open_values: np.ndarray,
                   n_heads: int, q_sinks: np.ndarray, sink_keys: np.ndarray, sink_values: np.ndarray
                   ) -> np.ndarray:
    """One query over the whole groups start // GROUP .. closed - 1 (key rows [R, key row], values [R,
    row_bytes] q4_0 rows of rotated heads, position p at row_of(table, block_size, p); positions before
    `start` left out), the open group's visible f16 rows open_keys, open_values [n_open, 2 w], and a
    window's sinks, f16 rows sink_keys, sink_values [n_sinks, 2 w] (none: 0 rows) scored with q_sinks (the
    query moved to where they sit, window.py's shift): a group per parallel task, partial softmaxes
    combined at the end."""
    w = open_keys.shape[1] // 2
    n_open = open_keys.shape[0]
    head_dim = q.shape[0] // n_heads
    n_kv = w // head_dim
    group = n_heads // n_kv
    scale = np.float32(1.0 / math.sqrt(head_dim))
    first = start // GROUP
    n_groups = max(closed - first, 0)
    n_spans = n_groups + (1 if n_open else 0) + (1 if sink_keys.shape[0] else 0)
    partial = np.empty((n_spans, q.shape[0]), np.float32)
    stats = np.empty((n_spans, n_heads, 2), np.float32)
    for c in prange(n_spans):
        if c < n_groups:
            at = first + c
            record = np.empty((GROUP, key_rows.shape[1]), np.uint8)
            _gather_record(key_rows, table, block_size, at, record)
            rec = record.reshape(-1)
            weights = np.zeros((n_heads, GROUP), np.float32)
            base = np.zeros(n_heads, np.float32)
            for g in range(n_kv):
                for j in range(head_dim):
                    ch = g * head_dim + j
                    d = half_at(rec, w * HALF + 2 * ch)
                    m = half_at(rec, w * (HALF + 2) + 2 * ch)
                    code = rec[ch * HALF : (ch + 1) * HALF]
                    for h in range(g * group, (g + 1) * group):
                        qv = q[h * head_dim + j]
                        base[h] += qv * m
                        coef = qv * d
                        wh = weights[h]
                        for t in range(HALF):
                            byte = code[t]
                            wh[t] += coef * np.float32(byte & 0xF)
                            wh[t + HALF] += coef * np.float32(byte >> 4)
            lo = max(start - at * GROUP, 0)  # the group's positions before the window: left out
            for h in range(n_heads):
                for t in range(lo, GROUP):
                    weights[h, t - lo] = (weights[h, t] + base[h]) * scale
            softmax_span(weights, GROUP - lo, stats[c])
            partial[c] = 0.0
            done = lo
            while done < GROUP:
                p = at * GROUP + done
                n = min(block_size - p % block_size, GROUP - done)
                r = row_of(table, block_size, p)
                mix_rows_at(weights, values[r : r + n], FMT_Q4_0, n_heads, partial[c], done - lo)
                done += n
            hadamard_rows(partial[c : c + 1], head_dim)  # the values were rotated: rotate the sum back
        elif c == n_groups and n_open:
            _attend_f16(q, open_keys, open_values, n_heads, partial[c], stats[c])
        else:
            _attend_f16(q_sinks, sink_keys, sink_values, n_heads, partial[c], stats[c])
    return combine_spans(partial, stats, n_heads)


@njit(cache=True, fastmath=True)
def _attend_f16(q: np.ndarray, keys: np.ndarray, values: np.ndarray, n_heads: int, partial: np.ndarray,
                stats: np.ndarray) -> None:
    """attend_span over f16 rows keys, values [n, 2 w] (the open group, a window's sinks)."""
    n, w = keys.shape[0], keys.shape[1] // 2
    k = np.empty((n, w), np.float32)
    v = np.empty((n, w), np.float32)
    decode_rows(keys, FMT_F16, k)
    decode_rows(values, FMT_F16, v)
    weights = np.empty((n_heads, n), np.float32)
    attend_span(q, k, v, n_heads, weights, partial, stats)


ONE_BLOCK = np.zeros(1, np.int32)  # the table of rows stored in order: one block holding them all


class KiviState:
    """What one sequence keeps besides its rows: the open group of each layer in f16, until its last
    position is written and it is rounded into its rows. The rows (key records, q4_0 values) live where
    the layout keeps them (prealloc: its own buffers; paged: the pool's blocks), addressed by a table.
    Groups past the capacity's last whole one are never closed: their rows stay open, as prealloc's."""

    def __init__(self, geometry: KVGeometry, capacity: int):
        self.geometry, self.capacity = geometry, capacity
        self.groups = capacity // GROUP
        layers, w = geometry.layers, geometry.kv_width
        self.open_keys = lazy_zeros((layers, GROUP, 2 * w), np.uint8)
        self.open_values = lazy_zeros((layers, GROUP, 2 * w), np.uint8)

    @property
    def nbytes(self) -> int:
        return self.open_keys.nbytes + self.open_values.nbytes

    def copy(self) -> KiviState:
        other = KiviState(self.geometry, self.capacity)
        other.open_keys[:] = self.open_keys
        other.open_values[:] = self.open_values
        return other

    def closed(self, end: int) -> int:
        """Whole groups among the first `end` positions."""
        return min(end // GROUP, self.groups)

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray, key_rows: np.ndarray,
              value_rows: np.ndarray, table: np.ndarray, block_size: int) -> None:
        done = 0
        while done < k.shape[0]:
            group, offset = divmod(pos + done, GROUP)
            n = min(k.shape[0] - done, GROUP - offset)
            rows = slice(offset, offset + n)
            encode_rows(np.ascontiguousarray(k[done : done + n]), FMT_F16, self.open_keys[layer, rows])
            encode_rows(np.ascontiguousarray(v[done : done + n]), FMT_F16, self.open_values[layer, rows])
            done += n
            if offset + n == GROUP and group < self.groups:
                self._close(layer, group, key_rows, value_rows, table, block_size)

    def _close(self, layer: int, group: int, key_rows: np.ndarray, value_rows: np.ndarray, table: np.ndarray,
               block_size: int) -> None:
        """Round the full open group into its rows."""
        g = self.geometry
        keys, values = (np.empty((GROUP, g.kv_width), np.float32) for _ in range(2))
        decode_rows(self.open_keys[layer], FMT_F16, keys)
        decode_rows(self.open_values[layer], FMT_F16, values)
        record = np.empty(GROUP * key_rows.shape[1], np.uint8)
        encode_channels(keys, *record_parts(record, g.kv_width))
        hadamard_rows(values, g.head_dim)
        stored = np.empty((GROUP, value_rows.shape[1]), np.uint8)
        encode_rows(values, FMT_Q4_0, stored)
        rows = rows_of(table, block_size, group * GROUP, (group + 1) * GROUP)
        key_rows[rows] = record.reshape(GROUP, -1)
        value_rows[rows] = stored

    def read(self, layer: int, start: int, end: int, key_rows: np.ndarray, value_rows: np.ndarray,
             table: np.ndarray, block_size: int, written: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """float32 keys and values of positions start .. end - 1 (whole groups decoded from their first),
        as they are once `written` positions (default: end) went in: a group closed by then from its rows."""
        g = self.geometry
        closed, first = self.closed(end if written is None else written), start // GROUP
        last = min(closed, -(-end // GROUP))  # groups decoded from their rows: first .. last - 1
        begin = min(first, last) * GROUP  # the first position decoded
        keys, values = (np.empty((max(end, last * GROUP) - begin, g.kv_width), np.float32) for _ in range(2))
        record = np.empty((GROUP, key_rows.shape[1]), np.uint8)
        for group in range(first, last):
            _gather_record(key_rows, table, block_size, group, record)
            at = slice(group * GROUP - begin, (group + 1) * GROUP - begin)
            decode_channels(*record_parts(record.reshape(-1), g.kv_width), keys[at])
        n_closed = last * GROUP - begin
        closed_rows = rows_of(table, block_size, begin, last * GROUP)
        decode_rows(value_rows[closed_rows], FMT_Q4_0, values[:n_closed])
        hadamard_rows(values[:n_closed], g.head_dim)
        n_open = max(end - last * GROUP, 0)  # the open group's (last is then closed): begin is never past it
        decode_rows(self.open_keys[layer, :n_open], FMT_F16, keys[n_closed : n_closed + n_open])
        decode_rows(self.open_values[layer, :n_open], FMT_F16, values[n_closed : n_closed + n_open])
        return keys[start - begin : end - begin], values[start - begin : end - begin]

    def attend(self, layer: int, query: np.ndarray, start: int, end: int, key_rows: np.ndarray,
               value_rows: np.ndarray, table: np.ndarray, block_size: int,
               sinks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """The query at end - 1 over positions start .. end - 1, and a window's sinks: (their query,
        their f16 keys and values)."""
        closed = self.closed(end)
        skip = max(start - closed * GROUP, 0)  # open rows before the window
        visible = slice(skip, end - closed * GROUP)
        if sinks is None:
            sinks = (query, self.open_keys[layer, :0], self.open_values[layer, :0])
        return attention_kivi(query, key_rows, value_rows, table, block_size, start, closed,
                              self.open_keys[layer, visible], self.open_values[layer, visible],
                              self.geometry.heads, *sinks)


class KiviStore:
    """The buffers of a q4_kivi cache: every layer's whole groups' rows in order, and the KiviState."""

    def __init__(self, geometry: KVGeometry, capacity: int):
        self.state = KiviState(geometry, capacity)
        self.geometry = geometry
        rows, layers = self.state.groups * GROUP, geometry.layers
        self.key_rows = lazy_zeros((layers, rows, key_row_bytes(geometry)), np.uint8)
        self.values = lazy_zeros((layers, rows, value_row_bytes(geometry)), np.uint8)
        self.table, self._block = ONE_BLOCK, max(rows, 1)  # one block holding every row

    @property
    def nbytes(self) -> int:
        return self.key_rows.nbytes + self.values.nbytes + self.state.nbytes

    def _rows(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        return self.key_rows[layer], self.values[layer], self.table, self._block

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self.state.write(layer, pos, k, v, *self._rows(layer))

    write_stored = write  # snapshots hold q4_kivi rows as float32

    def read(self, layer: int, end: int, start: int = 0, written: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """float32 rows of positions start .. end - 1, as they are once `written` (default: end) went in."""
        return self.state.read(layer, start, end, *self._rows(layer), written)

    stored = read

    def attend(self, layer: int, query: np.ndarray, end: int, start: int = 0) -> np.ndarray:
        return self.state.attend(layer, query, start, end, *self._rows(layer))

    def clear(self) -> None:
        pass  # groups and open rows past the cache's length are never read


class KiviRing(RingSinks, KiviStore):
    """One window cache's q4_kivi rows (`inferno.kv.window`): key groups in a ring of `ring_blocks`
    blocks of GROUP positions, through the table of a ring (row_of wraps), which the state closes
    forever; and the sinks' rows in f16, as the open group keeps its own. Until the window slides, every
    position is in the ring and attention is prealloc's; after, the sinks are a span of their own."""

    SINK_FMT, SINK_ROTATED = FMT_F16, False
    block = GROUP  # a prefill piece ends at a block's end at the latest (see ring_blocks)

    def __init__(self, geometry: KVGeometry, window: int, sinks: int):
        self.state = KiviState(geometry, UNBOUNDED)
        self.geometry = geometry
        blocks, layers, w = ring_blocks(window, sinks), geometry.layers, geometry.kv_width
        self.key_rows = lazy_zeros((layers, blocks * GROUP, key_row_bytes(geometry)), np.uint8)
        self.values = lazy_zeros((layers, blocks * GROUP, value_row_bytes(geometry)), np.uint8)
        self.table, self._block = np.arange(blocks, dtype=np.int32), GROUP
        self._make_sinks(layers, sinks, 2 * w)
