"""q4_recent: 4 bits a value for the old rows, 8 for the newest, a key's constant part taken out.

Three measured facts make it (SmolLM2, 512 tokens, rounding simulated first, see the README):
- Attention leans on the newest positions, so their rounding costs the most: the newest RECENT
  positions are kept as q8_0 blocks too (a ring of RECENT rows per layer), and attention reads them
  there. Every position's 4-bit row is written at once from the float row, so no row is rounded twice.
- A key's channels carry a large part that changes slowly along positions, which sets every block's
  scale. Any vector subtracted from all keys shifts every score of a query by the same amount, which
  softmax ignores; a different vector per segment of SEGMENT positions is added back as one dot per
  segment and query head. Keys from position SEGMENT on are stored minus the mean of the previous
  segment's keys (as stored, so a cache rebuilt from its own rows gets the same means).
- A Hadamard rotation of each head spreads the few huge channels left over all of them, so one f16
  scale fits a whole head of 64 values (4.25 bits) instead of q4_0's 32 (4.5).

Bytes: 4.25 bits a value for every position but the last RECENT of the capacity (which never leave
the ring), q8_0's 8.5 for the ring, and an f16 mean per key channel and segment after the first. At
512 tokens that is 4.48 bits a value (at most 4.5 from 480 tokens on), 4.35 at 2048, 4.32 at 8192.

Rows are stored rotated (`inferno.kv.blocks`): the query is rotated once per step and the output
rotated back once, and the segment means are kept rotated too.

Where body rows live is the layout's: position p's is found through a block table as
`blocks.attend_tables` finds a row (prealloc: one block; paged: the pool's blocks; window: a ring of
blocks, `RecentRing`). The ring and the means are the sequence's own (`RecentState`); a window's state
runs past any capacity, its means a ring too. A window cache's sinks are kept in q8_0 as the ring's
rows are, and read as one more span, scored with a query of their own.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from inferno.errors import InfernoError
from inferno.kernels.attention import combine_spans, decode_span, softmax_span
from inferno.kernels.jit import njit
from inferno.kernels.llvm_ir import prefetch_ahead
from inferno.kv.blocks import (
    BLOCK,
    FMT_Q4_64,
    FMT_Q8_0,
    decode_rows,
    encode_rows,
    float_to_half,
    hadamard_rows,
    half_at,
    half_to_float,
    mix_rows,
    score_rows,
)
from inferno.kv.geometry import KVGeometry
from inferno.kv.memory import lazy_zeros
from inferno.kv.sinks import RingSinks
from inferno.kv.vectors import PACK_Q4, pair_axpys, pair_dots

RECENT = 22  # newest positions kept in q8_0
SEGMENT = 128  # positions sharing one key mean
SCALED = 2 * BLOCK  # values sharing a scale in the body (FMT_Q4_64): two 32-value blocks of nibbles
SCALED_BYTES = 2 + SCALED // 2
RING_BYTES = 2 + BLOCK  # a q8_0 block of the ring: f16 scale, 32 int8
UNBOUNDED = 2**62  # the capacity of a window's state, which runs past any: every row goes into the body


def body_row_bytes(width: int) -> int:
    return width // SCALED * SCALED_BYTES


def ring_row_bytes(width: int) -> int:
    return width // BLOCK * RING_BYTES


def split(capacity: int) -> tuple[int, int, int]:
    """Rows of the 4-bit body, of the q8_0 ring, and key means, for `capacity` positions."""
    ring = min(RECENT, capacity)
    body = capacity - ring
    return body, ring, max(0, -(-body // SEGMENT) - 1)


def check_geometry(geometry: KVGeometry) -> None:
    head_dim = geometry.head_dim
    if head_dim % SCALED or head_dim & (head_dim - 1):
        raise InfernoError(f"q4_recent rotates heads and rounds 64 values together, which needs a "
                           f"power-of-two head_dim of at least 64, not {head_dim}")


def planned_nbytes(geometry: KVGeometry, capacity: int) -> int:
    body, _, _ = split(capacity)
    body_bytes = geometry.layers * 2 * body * body_row_bytes(geometry.kv_width)
    return body_bytes + sequence_nbytes(geometry, capacity)


def ring_blocks(window: int, sinks: int) -> int:
    """Blocks of SEGMENT positions in a window cache's ring (`RecentRing`), and key means it keeps:
    every position until the window slides (sinks + window); after, what a query sees while a prefill
    piece, which ends at the end of its segment at the latest, writes that segment over the oldest block
    (window.py); and always the previous segment, whose mean is taken when a segment starts."""
    return max(-(-(sinks + window) // SEGMENT), 1 + -(-(window - 1) // SEGMENT), 2)


def ring_nbytes(geometry: KVGeometry, window: int, sinks: int) -> int:
    """Bytes of a RecentRing: its blocks, the q8_0 ring, the key means and the sinks in q8_0."""
    blocks, w = ring_blocks(window, sinks), geometry.kv_width
    body = 2 * blocks * SEGMENT * body_row_bytes(w)
    return geometry.layers * (body + 2 * (RECENT + sinks) * ring_row_bytes(w) + blocks * w * 2)


def sequence_nbytes(geometry: KVGeometry, capacity: int) -> int:
    """Bytes of what a sequence of `capacity` positions keeps besides its body rows: the q8_0 ring and the
    key means (`RecentState`)."""
    _, ring, means = split(capacity)
    w = geometry.kv_width
    return geometry.layers * (2 * ring * ring_row_bytes(w) + means * w * 2)


@njit(cache=True)
def body_row(table: np.ndarray, block_size: int, p: int) -> int:
    """The body row of position p: row table[p // block_size] * block_size + p % block_size of the rows
    (prealloc: one block holding them all; paged: the pool's blocks, blocks.attend_tables' addressing).
    A table shorter than the positions is a ring of blocks (a window cache's): its index wraps."""
    index = p // block_size
    slot = index if index < table.shape[0] else index % table.shape[0]
    return np.int64(table[slot]) * block_size + p - index * block_size


@njit(cache=True, fastmath=True)
def _segment_mean(body_keys: np.ndarray, table: np.ndarray, block_size: int, means: np.ndarray,
                  segment: int) -> None:
    """means[segment - 1]: f16 bits of the mean of segment - 1's stored keys (gathered from their
    blocks), their own mean added back. Means are a ring: segment s's at (s - 1) % len (a window's state
    keeps the last few; others every one)."""
    w, kept = means.shape[1], means.shape[0]
    stored = np.empty((SEGMENT, body_keys.shape[1]), np.uint8)
    done = 0
    while done < SEGMENT:
        p = (segment - 1) * SEGMENT + done
        n = min(block_size - p % block_size, SEGMENT - done)
        r = body_row(table, block_size, p)
        stored[done : done + n] = body_keys[r : r + n]
        done += n
    rows = np.empty((SEGMENT, w), np.float32)
    decode_rows(stored, FMT_Q4_64, rows)
    for c in range(w):
        total = np.float32(0.0)
        for t in range(SEGMENT):
            total += rows[t, c]
        mean = total / np.float32(SEGMENT)
        if segment >= 2:
            mean += half_to_float(means[(segment - 2) % kept, c])
        means[(segment - 1) % kept, c] = float_to_half(mean)


@njit(cache=True)
def _body_layout(width: int, n_heads: int, row_bytes: int) -> tuple[int, int, int, int]:
    """head_dim, scales per head, KV heads and query heads per KV head of body rows [row_bytes]
    against n_heads query heads of `width` values in all."""
    head_dim = width // n_heads
    per_head = head_dim // SCALED
    n_kv = row_bytes // SCALED_BYTES // per_head
    return head_dim, per_head, n_kv, n_heads // n_kv


@njit(cache=True, fastmath=True)
def score_body(q: np.ndarray, keys: np.ndarray, n_heads: int, weights: np.ndarray, col: int = 0) -> None:
    """blocks.score_rows_at over body rows keys [S, row bytes] (FMT_Q4_64) into weights[:, col : col + S].
    Its own loop, with the format's offsets as constants: one generic loop over both layouts cost f16
    rows 30% of speed."""
    head_dim, per_head, n_kv, group = _body_layout(q.shape[0], n_heads, keys.shape[1])
    width = weights.shape[1]
    for h in range(n_heads):
        for s in range(keys.shape[0]):
            weights[h, col + s] = 0.0
    for s in range(keys.shape[0]):
        prefetch_ahead(keys, s)
        for g in range(n_kv):
            for c in range(per_head):
                o = (g * per_head + c) * SCALED_BYTES
                pair_dots(PACK_Q4, q, (g * group * per_head + c) * SCALED, head_dim, group, keys[s], o + 2,
                          weights, g * group * width + col + s, width, half_at(keys[s], o))


@njit(cache=True, fastmath=True)
def mix_body(weights: np.ndarray, values: np.ndarray, n_heads: int, out: np.ndarray, col: int = 0) -> None:
    """blocks.mix_rows_at over body rows values [S, row bytes] (FMT_Q4_64), weights[:, col : col + S]."""
    head_dim, per_head, n_kv, group = _body_layout(out.shape[0], n_heads, values.shape[1])
    width = weights.shape[1]
    for s in range(values.shape[0]):
        prefetch_ahead(values, s)
        for g in range(n_kv):
            for c in range(per_head):
                o = (g * per_head + c) * SCALED_BYTES
                pair_axpys(PACK_Q4, out, (g * group * per_head + c) * SCALED, head_dim, group, weights,
                           g * group * width + col + s, width, half_at(values[s], o), values[s], o + 2)


@njit(cache=True, fastmath=True)
def write_rows(k: np.ndarray, v: np.ndarray, pos: int, head_dim: int, body_keys: np.ndarray,
               body_values: np.ndarray, table: np.ndarray, block_size: int, n_body: int, means: np.ndarray,
               ring_keys: np.ndarray, ring_values: np.ndarray) -> None:
    """Rows k, v [n, w] of positions pos .. pos + n - 1 of one layer into its stores: body rows [R, row
    bytes] 4-bit at body_row(table, block_size, p) for p < n_body, means [segments - 1, w] f16 bits, ring
    [ring, row bytes] q8_0. The previous segment's body rows must be held when a segment starts; means
    are a ring (_segment_mean)."""
    keys, values = k.copy(), v.copy()
    hadamard_rows(keys, head_dim)
    hadamard_rows(values, head_dim)
    n_ring = ring_keys.shape[0]
    for i in range(keys.shape[0]):
        p = pos + i
        slot = p % n_ring
        encode_rows(keys[i : i + 1], FMT_Q8_0, ring_keys[slot : slot + 1])
        encode_rows(values[i : i + 1], FMT_Q8_0, ring_values[slot : slot + 1])
        if p >= n_body:
            continue  # the capacity's last positions never leave the ring
        segment = p // SEGMENT
        if segment >= 1:
            if p % SEGMENT == 0:
                _segment_mean(body_keys, table, block_size, means, segment)
            m = (segment - 1) % means.shape[0]
            for c in range(keys.shape[1]):
                keys[i, c] -= half_to_float(means[m, c])
        r = body_row(table, block_size, p)
        encode_rows(keys[i : i + 1], FMT_Q4_64, body_keys[r : r + 1])
        encode_rows(values[i : i + 1], FMT_Q4_64, body_values[r : r + 1])


@njit(cache=True, fastmath=True)
def _body_runs(query: np.ndarray, rows: np.ndarray, table: np.ndarray, block_size: int, p0: int, p1: int,
               n_heads: int, weights: np.ndarray, out: np.ndarray, mix: bool) -> None:
    """score_body (or mix_body) over body positions p0 .. p1 - 1, one contiguous run of rows per block
    (blocks._each_run for the body's format)."""
    p, col = p0, 0
    while p < p1:
        n = min(block_size - p % block_size, p1 - p)
        r = body_row(table, block_size, p)
        if mix:
            mix_body(weights, rows[r : r + n], n_heads, out, col)
        else:
            score_body(query, rows[r : r + n], n_heads, weights, col)
        p += n
        col += n


@njit(cache=True, fastmath=True, parallel=True)
def attention_recent(q: np.ndarray, body_keys: np.ndarray, body_values: np.ndarray, table: np.ndarray,
                     block_size: int, means: np.ndarray, ring_keys: np.ndarray, ring_values: np.ndarray,
                     start: int, split_at: int, end: int, n_heads: int, span: int, q_sinks: np.ndarray,
                     sink_keys: np.ndarray, sink_values: np.ndarray) -> np.ndarray:
    """One query over positions start .. end - 1: the body's rows before split_at (position p at
    body_row(table, block_size, p)), the ring's from there on (slot p % ring: one run of slots, or two
    where it wraps); and a window's sinks, q8_0 rows sink_keys, sink_values [n_sinks, row bytes] as the
    ring's (none: 0 rows), scored with q_sinks (the query moved to where they sit, window.py's shift).
    Spans of `span` body rows (kernels.decode_span), the ring's runs and the sinks run in parallel; their
    partial softmaxes are combined at the end (kernels.combine_spans)."""
    head_dim, _, _, group = _body_layout(q.shape[0], n_heads, body_keys.shape[1])
    query = np.empty((2, q.shape[0]), np.float32)  # the query, and the sinks' one
    query[0] = q
    query[1] = q_sinks
    hadamard_rows(query, head_dim)
    query *= np.float32(1.0 / math.sqrt(head_dim))
    # each segment's mean shifts its scores: q_h . mean (rotated), per segment read and query head
    first_segment = start // SEGMENT
    last_segment = max(split_at - 1, start) // SEGMENT
    shift = np.zeros((last_segment - first_segment + 1, n_heads), np.float32)
    mean = np.empty(means.shape[1], np.float32)  # one segment's, as floats: the dots below vectorize
    # only the segments of the body positions read (segment m + 1 takes means[m % kept], a ring)
    for m in range(max(first_segment - 1, 0), max(split_at - 1, 0) // SEGMENT):
        for c in range(mean.shape[0]):
            mean[c] = half_to_float(means[m % means.shape[0], c])
        for h in range(n_heads):
            base = h // group * head_dim
            total = np.float32(0.0)
            for j in range(head_dim):
                total += query[0, h * head_dim + j] * mean[base + j]
            shift[m + 1 - first_segment, h] = total
    n_body = max(split_at - start, 0)
    body_spans = (n_body + span - 1) // span
    ring, first = ring_keys.shape[0], max(start, split_at)
    slot0 = first % ring
    slot1 = slot0 + end - first  # past `ring`: the run wraps to slot 0
    runs = np.array([[slot0, min(slot1, ring)], [0, slot1 - ring]])
    n_runs = (slot1 > slot0) + (slot1 > ring)
    n_spans = body_spans + n_runs + (1 if sink_keys.shape[0] else 0)
    partial = np.zeros((n_spans, q.shape[0]), np.float32)
    stats = np.empty((n_spans, n_heads, 2), np.float32)
    for c in prange(n_spans):
        if c < body_spans:
            s0 = start + c * span
            s1 = min(s0 + span, split_at)
            weights = np.empty((n_heads, s1 - s0), np.float32)
            _body_runs(query[0], body_keys, table, block_size, s0, s1, n_heads, weights, partial[c], False)
            for h in range(n_heads):  # along each head's row of scores: contiguous
                for s in range(s1 - s0):
                    weights[h, s] += shift[(s0 + s) // SEGMENT - first_segment, h]
            softmax_span(weights, s1 - s0, stats[c])
            _body_runs(query[0], body_values, table, block_size, s0, s1, n_heads, weights, partial[c], True)
        elif c < body_spans + n_runs:
            s0, s1 = runs[c - body_spans, 0], runs[c - body_spans, 1]
            _q8_span(query[0], ring_keys[s0:s1], ring_values[s0:s1], n_heads, partial[c], stats[c])
        else:
            _q8_span(query[1], sink_keys, sink_values, n_heads, partial[c], stats[c])
    out = combine_spans(partial, stats, n_heads).reshape(1, -1)
    hadamard_rows(out, head_dim)
    return out[0]


@njit(cache=True, fastmath=True)
def _q8_span(query: np.ndarray, keys: np.ndarray, values: np.ndarray, n_heads: int, partial: np.ndarray,
             stats: np.ndarray) -> None:
    """One span of q8_0 rows keys, values [n, row bytes] (a run of the ring, a window's sinks) for the
    rotated, scaled query: partial += its softmax-weighted values, stats its (max, sum)."""
    weights = np.empty((n_heads, keys.shape[0]), np.float32)
    score_rows(query, keys, FMT_Q8_0, n_heads, weights)
    softmax_span(weights, keys.shape[0], stats)
    mix_rows(weights, values, FMT_Q8_0, n_heads, partial)


ONE_BLOCK = np.zeros(1, np.int32)  # the table of body rows stored in order: one block holding them all


class RecentState:
    """What one sequence keeps besides its body rows, per layer: the q8_0 ring of its newest RECENT rows
    and its key means. The body rows live where the layout keeps them (prealloc: its own buffer; paged:
    the pool's blocks; window: a ring of blocks), addressed by a block table; a segment's mean is taken
    from its rows when the next segment starts, so a layout that drops old rows keeps those of the
    previous segment until then (`first_kept`). A window's state (kept_means: how many) runs past any
    capacity: every row goes into the body, and the means of the last kept_means segments are a ring."""

    def __init__(self, geometry: KVGeometry, capacity: int, kept_means: int | None = None):
        check_geometry(geometry)
        self.geometry, self.capacity, self.kept_means = geometry, capacity, kept_means
        self.n_body, ring, means = split(capacity)
        if kept_means is not None:
            self.n_body, means = UNBOUNDED, kept_means
        layers, w = geometry.layers, geometry.kv_width
        self.means = lazy_zeros((layers, means, w), np.uint16)
        self.ring_keys = lazy_zeros((layers, ring, ring_row_bytes(w)), np.uint8)
        self.ring_values = lazy_zeros((layers, ring, ring_row_bytes(w)), np.uint8)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.means, self.ring_keys, self.ring_values))

    def copy(self) -> RecentState:
        """The same state for a fork (its blocks are shared; these are its own)."""
        other = RecentState(self.geometry, self.capacity, self.kept_means)
        for name in ("means", "ring_keys", "ring_values"):
            getattr(other, name)[:] = getattr(self, name)
        return other

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray, body_keys: np.ndarray,
              body_values: np.ndarray, table: np.ndarray, block_size: int) -> None:
        write_rows(np.ascontiguousarray(k, np.float32), np.ascontiguousarray(v, np.float32), pos,
                   self.geometry.head_dim, body_keys, body_values, table, block_size, self.n_body,
                   self.means[layer], self.ring_keys[layer], self.ring_values[layer])

    @staticmethod
    def first_kept(length: int) -> int:
        """The first body position writes after the first `length` still read: the open segment's, or,
        when the next write starts a segment, the previous one's (its mean is taken then)."""
        return max(length - 1, 0) // SEGMENT * SEGMENT

    def split_at(self, end: int) -> int:
        """The first position of the first `end` that attention reads from the ring."""
        return max(end - self.ring_keys.shape[1], 0)

    def read(self, layer: int, start: int, end: int, body_keys: np.ndarray, body_values: np.ndarray,
             table: np.ndarray, block_size: int, written: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """float32 keys and values of positions start .. end - 1, as attention reads them once `written`
        positions (default: end) went in: the ring's newest RECENT of those, the body the others."""
        g = self.geometry
        at = min(max(self.split_at(end if written is None else written), start), end)
        positions = np.arange(start, at)
        index = positions // block_size
        rows = table[index % len(table)].astype(np.int64) * block_size + positions - index * block_size
        keys, values = (np.empty((end - start, g.kv_width), np.float32) for _ in range(2))
        decode_rows(body_keys[rows], FMT_Q4_64, keys[: at - start])
        decode_rows(body_values[rows], FMT_Q4_64, values[: at - start])
        for segment in range(max(start // SEGMENT, 1), -(-at // SEGMENT)):
            span = slice(max(segment * SEGMENT, start) - start, min((segment + 1) * SEGMENT, at) - start)
            keys[span] += self.means[layer, (segment - 1) % self.means.shape[1]].view(np.float16)
        slots = np.arange(at, end) % self.ring_keys.shape[1]
        decode_rows(self.ring_keys[layer, slots], FMT_Q8_0, keys[at - start :])
        decode_rows(self.ring_values[layer, slots], FMT_Q8_0, values[at - start :])
        hadamard_rows(keys, g.head_dim)  # its own inverse
        hadamard_rows(values, g.head_dim)
        return keys, values

    def attend(self, layer: int, query: np.ndarray, start: int, end: int, body_keys: np.ndarray,
               body_values: np.ndarray, table: np.ndarray, block_size: int,
               sinks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """The query at end - 1 over positions start .. end - 1, and a window's sinks: (their query,
        their q8_0 keys and values)."""
        split_at = self.split_at(end)
        if sinks is None:
            sinks = (query, self.ring_keys[layer, :0], self.ring_values[layer, :0])
        return attention_recent(query, body_keys, body_values, table, block_size, self.means[layer],
                                self.ring_keys[layer], self.ring_values[layer], start, split_at, end,
                                self.geometry.heads, decode_span(max(split_at - start, 1)), *sinks)


class RecentStore:
    """The buffers of a q4_recent cache: the 4-bit body of every layer in order, and the RecentState."""

    def __init__(self, geometry: KVGeometry, capacity: int):
        self.state = RecentState(geometry, capacity)
        self.geometry = geometry
        layers, body, w = geometry.layers, self.state.n_body, geometry.kv_width
        self.body_keys = lazy_zeros((layers, body, body_row_bytes(w)), np.uint8)
        self.body_values = lazy_zeros((layers, body, body_row_bytes(w)), np.uint8)
        self.table, self._block = ONE_BLOCK, max(body, 1)  # one block holding every body row

    @property
    def nbytes(self) -> int:
        return self.body_keys.nbytes + self.body_values.nbytes + self.state.nbytes

    def _rows(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        return self.body_keys[layer], self.body_values[layer], self.table, self._block

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self.state.write(layer, pos, k, v, *self._rows(layer))

    write_stored = write  # snapshots hold q4_recent rows as float32, rounded again on loading

    def read(self, layer: int, end: int, start: int = 0, written: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """float32 rows of positions start .. end - 1, as attention reads them once `written` (default:
        end) went in."""
        return self.state.read(layer, start, end, *self._rows(layer), written)

    stored = read

    def attend(self, layer: int, query: np.ndarray, end: int, start: int = 0) -> np.ndarray:
        return self.state.attend(layer, query, start, end, *self._rows(layer))

    def clear(self) -> None:
        pass  # rows past the cache's length are never read; the means are written again with them


class RecentRing(RingSinks, RecentStore):
    """One window cache's q4_recent rows (`inferno.kv.window`): body rows in a ring of `ring_blocks`
    blocks of SEGMENT positions, through the table of a ring (body_row wraps), with the state's key
    means a ring as long; and the sinks' rows in q8_0, as the ring of the newest keeps its own. Until the
    window slides, every position is in the ring and attention is prealloc's; after, the sinks are a
    span of their own."""

    SINK_FMT, SINK_ROTATED = FMT_Q8_0, True
    block = SEGMENT  # a prefill piece ends at a block's end at the latest (see ring_blocks)

    def __init__(self, geometry: KVGeometry, window: int, sinks: int):
        blocks, layers, w = ring_blocks(window, sinks), geometry.layers, geometry.kv_width
        self.state = RecentState(geometry, UNBOUNDED, kept_means=blocks)
        self.geometry = geometry
        self.body_keys = lazy_zeros((layers, blocks * SEGMENT, body_row_bytes(w)), np.uint8)
        self.body_values = lazy_zeros((layers, blocks * SEGMENT, body_row_bytes(w)), np.uint8)
        self.table, self._block = np.arange(blocks, dtype=np.int32), SEGMENT
        self._make_sinks(layers, sinks, ring_row_bytes(w))
