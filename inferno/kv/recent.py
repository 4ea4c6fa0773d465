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
from inferno.kv.vectors import KIND_Q4, pair_axpys, pair_dots

RECENT = 22  # newest positions kept in q8_0
SEGMENT = 128  # positions sharing one key mean
SCALED = 2 * BLOCK  # values sharing a scale in the body (FMT_Q4_64): two 32-value blocks of nibbles
SCALED_BYTES = 2 + SCALED // 2
RING_BYTES = 2 + BLOCK  # a q8_0 block of the ring: f16 scale, 32 int8


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
    body, ring, means = split(capacity)
    w = geometry.kv_width
    per_layer = 2 * (body * body_row_bytes(w) + ring * ring_row_bytes(w)) + means * w * 2
    return geometry.layers * per_layer


@njit(cache=True, fastmath=True)
def _segment_mean(body_keys: np.ndarray, means: np.ndarray, segment: int) -> None:
    """means[segment - 1]: f16 bits of the mean of segment - 1's stored keys, their own mean added back."""
    w = means.shape[1]
    rows = np.empty((SEGMENT, w), np.float32)
    decode_rows(body_keys[(segment - 1) * SEGMENT : segment * SEGMENT], FMT_Q4_64, rows)
    for c in range(w):
        total = np.float32(0.0)
        for t in range(SEGMENT):
            total += rows[t, c]
        mean = total / np.float32(SEGMENT)
        if segment >= 2:
            mean += half_to_float(means[segment - 2, c])
        means[segment - 1, c] = float_to_half(mean)


@njit(cache=True)
def _body_layout(width: int, n_heads: int, row_bytes: int) -> tuple[int, int, int, int]:
    """head_dim, scales per head, KV heads and query heads per KV head of body rows [row_bytes]
    against n_heads query heads of `width` values in all."""
    head_dim = width // n_heads
    per_head = head_dim // SCALED
    n_kv = row_bytes // SCALED_BYTES // per_head
    return head_dim, per_head, n_kv, n_heads // n_kv


@njit(cache=True, fastmath=True)
def score_body(q: np.ndarray, keys: np.ndarray, n_heads: int, weights: np.ndarray) -> None:
    """blocks.score_rows over body rows keys [S, row bytes] (FMT_Q4_64). Its own loop, with the
    format's offsets as constants: one generic loop over both layouts cost f16 rows 30% of speed."""
    head_dim, per_head, n_kv, group = _body_layout(q.shape[0], n_heads, keys.shape[1])
    width = weights.shape[1]
    weights[:] = 0.0
    for s in range(keys.shape[0]):
        prefetch_ahead(keys, s)
        for g in range(n_kv):
            for c in range(per_head):
                o = (g * per_head + c) * SCALED_BYTES
                pair_dots(KIND_Q4, q, (g * group * per_head + c) * SCALED, head_dim, group, keys[s], o + 2,
                          weights, g * group * width + s, width, half_at(keys[s], o))


@njit(cache=True, fastmath=True)
def mix_body(weights: np.ndarray, values: np.ndarray, n_heads: int, out: np.ndarray) -> None:
    """blocks.mix_rows over body rows values [S, row bytes] (FMT_Q4_64)."""
    head_dim, per_head, n_kv, group = _body_layout(out.shape[0], n_heads, values.shape[1])
    width = weights.shape[1]
    for s in range(values.shape[0]):
        prefetch_ahead(values, s)
        for g in range(n_kv):
            for c in range(per_head):
                o = (g * per_head + c) * SCALED_BYTES
                pair_axpys(KIND_Q4, out, (g * group * per_head + c) * SCALED, head_dim, group, weights,
                           g * group * width + s, width, half_at(values[s], o), values[s], o + 2)


@njit(cache=True, fastmath=True)
def write_rows(k: np.ndarray, v: np.ndarray, pos: int, head_dim: int, body_keys: np.ndarray,
               body_values: np.ndarray, means: np.ndarray, ring_keys: np.ndarray,
               ring_values: np.ndarray) -> None:
    """Rows k, v [n, w] of positions pos .. pos + n - 1 of one layer into its stores: body [capacity -
    ring, row bytes] 4-bit, means [segments - 1, w] f16 bits, ring [ring, row bytes] q8_0."""
    keys, values = k.copy(), v.copy()
    hadamard_rows(keys, head_dim)
    hadamard_rows(values, head_dim)
    n_ring, n_body = ring_keys.shape[0], body_keys.shape[0]
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
                _segment_mean(body_keys, means, segment)
            for c in range(keys.shape[1]):
                keys[i, c] -= half_to_float(means[segment - 1, c])
        encode_rows(keys[i : i + 1], FMT_Q4_64, body_keys[p : p + 1])
        encode_rows(values[i : i + 1], FMT_Q4_64, body_values[p : p + 1])


@njit(cache=True, fastmath=True, parallel=True)
def attention_recent(q: np.ndarray, body_keys: np.ndarray, body_values: np.ndarray, means: np.ndarray,
                     ring_keys: np.ndarray, ring_values: np.ndarray, start: int, split_at: int,
                     end: int, n_heads: int, span: int) -> np.ndarray:
    """One query over positions start .. end - 1: the body's rows before split_at, the ring's from
    there on (slot p % ring: one run of slots, or two where it wraps). Spans of `span` body rows
    (kernels.decode_span) and the ring's runs run in parallel; their partial softmaxes are combined
    at the end (kernels.combine_spans)."""
    head_dim, _, _, group = _body_layout(q.shape[0], n_heads, body_keys.shape[1])
    query = q.copy().reshape(1, -1)
    hadamard_rows(query, head_dim)
    query *= np.float32(1.0 / math.sqrt(head_dim))
    # each segment's mean shifts its scores: q_h . mean (rotated), per segment and query head
    shift = np.zeros((means.shape[0] + 1, n_heads), np.float32)
    mean = np.empty(means.shape[1], np.float32)  # one segment's, as floats: the dots below vectorize
    for m in range(means.shape[0]):
        for c in range(mean.shape[0]):
            mean[c] = half_to_float(means[m, c])
        for h in range(n_heads):
            base = h // group * head_dim
            total = np.float32(0.0)
            for j in range(head_dim):
                total += query[0, h * head_dim + j] * mean[base + j]
            shift[m + 1, h] = total
    n_body = max(split_at - start, 0)
    body_spans = (n_body + span - 1) // span
    ring, first = ring_keys.shape[0], max(start, split_at)
    slot0 = first % ring
    slot1 = slot0 + end - first  # past `ring`: the run wraps to slot 0
    runs = np.array([[slot0, min(slot1, ring)], [0, slot1 - ring]])
    n_spans = body_spans + (slot1 > slot0) + (slot1 > ring)
    partial = np.zeros((n_spans, q.shape[0]), np.float32)
    stats = np.empty((n_spans, n_heads, 2), np.float32)
    for c in prange(n_spans):
        if c < body_spans:
            s0 = start + c * span
            s1 = min(s0 + span, split_at)
            weights = np.empty((n_heads, s1 - s0), np.float32)
            score_body(query[0], body_keys[s0:s1], n_heads, weights)
            for h in range(n_heads):  # along each head's row of scores: contiguous
                for s in range(s1 - s0):
                    weights[h, s] += shift[(s0 + s) // SEGMENT, h]
            softmax_span(weights, s1 - s0, stats[c])
            mix_body(weights, body_values[s0:s1], n_heads, partial[c])
        else:
            s0, s1 = runs[c - body_spans, 0], runs[c - body_spans, 1]
            weights = np.empty((n_heads, s1 - s0), np.float32)
            score_rows(query[0], ring_keys[s0:s1], FMT_Q8_0, n_heads, weights)
            softmax_span(weights, s1 - s0, stats[c])
            mix_rows(weights, ring_values[s0:s1], FMT_Q8_0, n_heads, partial[c])
    out = combine_spans(partial, stats, n_heads).reshape(1, -1)
    hadamard_rows(out, head_dim)
    return out[0]


class RecentStore:
    """The buffers of a q4_recent cache, per layer: the 4-bit body, its key means, the q8_0 ring."""

    def __init__(self, geometry: KVGeometry, capacity: int):
        check_geometry(geometry)
        self.geometry = geometry
        body, ring, means = split(capacity)
        layers, w = geometry.layers, geometry.kv_width
        self.body_keys = lazy_zeros((layers, body, body_row_bytes(w)), np.uint8)
        self.body_values = lazy_zeros((layers, body, body_row_bytes(w)), np.uint8)
        self.means = lazy_zeros((layers, means, w), np.uint16)
        self.ring_keys = lazy_zeros((layers, ring, ring_row_bytes(w)), np.uint8)
        self.ring_values = lazy_zeros((layers, ring, ring_row_bytes(w)), np.uint8)

    @property
    def nbytes(self) -> int:
        arrays = (self.body_keys, self.body_values, self.means, self.ring_keys, self.ring_values)
        return sum(a.nbytes for a in arrays)

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        write_rows(np.ascontiguousarray(k, np.float32), np.ascontiguousarray(v, np.float32), pos,
                   self.geometry.head_dim, self.body_keys[layer], self.body_values[layer],
                   self.means[layer], self.ring_keys[layer], self.ring_values[layer])

    write_stored = write  # snapshots hold q4_recent rows as float32, rounded again on loading

    def _split_at(self, end: int) -> int:
        """The first position of the first `end` that attention reads from the ring."""
        return max(end - self.ring_keys.shape[1], 0)

    def read(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        g = self.geometry
        at = self._split_at(end)
        keys, values = (np.empty((end, g.kv_width), np.float32) for _ in range(2))
        decode_rows(self.body_keys[layer, :at], FMT_Q4_64, keys[:at])
        decode_rows(self.body_values[layer, :at], FMT_Q4_64, values[:at])
        for segment in range(1, -(-at // SEGMENT)):
            rows = slice(segment * SEGMENT, min((segment + 1) * SEGMENT, at))
            keys[rows] += self.means[layer, segment - 1].view(np.float16)
        slots = np.arange(at, end) % self.ring_keys.shape[1]
        decode_rows(self.ring_keys[layer, slots], FMT_Q8_0, keys[at:])
        decode_rows(self.ring_values[layer, slots], FMT_Q8_0, values[at:])
        hadamard_rows(keys, g.head_dim)  # its own inverse
        hadamard_rows(values, g.head_dim)
        return keys, values

    stored = read

    def attend(self, layer: int, query: np.ndarray, end: int, start: int = 0) -> np.ndarray:
        at, split_at = (layer,), self._split_at(end)
        return attention_recent(query, self.body_keys[at], self.body_values[at], self.means[at],
                                self.ring_keys[at], self.ring_values[at], start, split_at, end,
                                self.geometry.heads, decode_span(max(split_at - start, 1)))

    def clear(self) -> None:
        pass  # rows past the cache's length are never read; the means are written again with them
