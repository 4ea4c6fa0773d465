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
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from inferno.errors import InfernoError
from inferno.kernels.attention import attend_span, combine_spans, softmax_span
from inferno.kernels.jit import njit
from inferno.kv.blocks import (
    FMT_F16,
    FMT_Q4_0,
    decode_rows,
    encode_rows,
    float_to_half,
    hadamard_rows,
    half_to_float,
    mix_rows,
)
from inferno.kv.geometry import KVGeometry
from inferno.kv.memory import lazy_zeros

GROUP = 64  # positions per key group
HALF = GROUP // 2  # a code byte holds position t (low nibble) and t + HALF (high)
VALUE_ROW_BLOCK = (32, 18)  # q4_0: values per block, bytes per block


def value_row_bytes(geometry: KVGeometry) -> int:
    return geometry.kv_width // VALUE_ROW_BLOCK[0] * VALUE_ROW_BLOCK[1]


def planned_nbytes(geometry: KVGeometry, capacity: int) -> int:
    """Bytes of a q4_kivi store for `capacity` tokens: every whole group, and the open group in f16."""
    groups, w = capacity // GROUP, geometry.kv_width
    per_group = w * (HALF + 4) + GROUP * value_row_bytes(geometry)  # key codes, scale, minimum; values
    open_group = 2 * GROUP * w * 2
    return geometry.layers * (groups * per_group + open_group)


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


@njit(cache=True, fastmath=True, parallel=True)
def attention_kivi(q: np.ndarray, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray,
                   values: np.ndarray, open_keys: np.ndarray, open_values: np.ndarray,
                   n_heads: int) -> np.ndarray:
    """One query over whole groups (codes [groups, w, HALF], scales and mins [groups, w], values
    [groups * GROUP, row_bytes] q4_0 rows of rotated heads) and the open group's f16 rows open_keys,
    open_values [n_open, 2 w]: a group per parallel task, partial softmaxes combined at the end."""
    n_groups, w = codes.shape[0], codes.shape[1]
    n_open = open_keys.shape[0]
    head_dim = q.shape[0] // n_heads
    n_kv = w // head_dim
    group = n_heads // n_kv
    scale = np.float32(1.0 / math.sqrt(head_dim))
    n_spans = n_groups + (1 if n_open else 0)
    partial = np.empty((n_spans, q.shape[0]), np.float32)
    stats = np.empty((n_spans, n_heads, 2), np.float32)
    for c in prange(n_spans):
        if c < n_groups:
            weights = np.zeros((n_heads, GROUP), np.float32)
            base = np.zeros(n_heads, np.float32)
            for g in range(n_kv):
                for j in range(head_dim):
                    ch = g * head_dim + j
                    d = half_to_float(scales[c, ch])
                    m = half_to_float(mins[c, ch])
                    code = codes[c, ch]
                    for h in range(g * group, (g + 1) * group):
                        qv = q[h * head_dim + j]
                        base[h] += qv * m
                        coef = qv * d
                        wh = weights[h]
                        for t in range(HALF):
                            byte = code[t]
                            wh[t] += coef * np.float32(byte & 0xF)
                            wh[t + HALF] += coef * np.float32(byte >> 4)
            for h in range(n_heads):
                for t in range(GROUP):
                    weights[h, t] = (weights[h, t] + base[h]) * scale
            softmax_span(weights, GROUP, stats[c])
            partial[c] = 0.0
            mix_rows(weights, values[c * GROUP : (c + 1) * GROUP], FMT_Q4_0, n_heads, partial[c])
            hadamard_rows(partial[c : c + 1], head_dim)  # the values were rotated: rotate the sum back
        else:
            k = np.empty((n_open, w), np.float32)
            v = np.empty((n_open, w), np.float32)
            decode_rows(open_keys, FMT_F16, k)
            decode_rows(open_values, FMT_F16, v)
            weights = np.empty((n_heads, n_open), np.float32)
            attend_span(q, k, v, n_heads, weights, partial[c], stats[c])
    return combine_spans(partial, stats, n_heads)


class KiviStore:
    """The buffers of a q4_kivi cache: whole groups rounded, the open group of each layer in f16."""

    def __init__(self, geometry: KVGeometry, capacity: int):
        self.geometry = geometry
        self.groups = capacity // GROUP  # positions past the last whole group stay in the open group
        layers, w = geometry.layers, geometry.kv_width
        self.codes = lazy_zeros((layers, self.groups, w, HALF), np.uint8)
        self.scales = lazy_zeros((layers, self.groups, w), np.uint16)
        self.mins = lazy_zeros((layers, self.groups, w), np.uint16)
        self.values = lazy_zeros((layers, self.groups * GROUP, value_row_bytes(geometry)), np.uint8)
        self.open_keys = lazy_zeros((layers, GROUP, 2 * w), np.uint8)
        self.open_values = lazy_zeros((layers, GROUP, 2 * w), np.uint8)

    @property
    def nbytes(self) -> int:
        arrays = (self.codes, self.scales, self.mins, self.values, self.open_keys, self.open_values)
        return sum(a.nbytes for a in arrays)

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        done = 0
        while done < k.shape[0]:
            group, offset = divmod(pos + done, GROUP)
            n = min(k.shape[0] - done, GROUP - offset)
            rows = slice(offset, offset + n)
            encode_rows(np.ascontiguousarray(k[done : done + n]), FMT_F16, self.open_keys[layer, rows])
            encode_rows(np.ascontiguousarray(v[done : done + n]), FMT_F16, self.open_values[layer, rows])
            done += n
            if offset + n == GROUP and group < self.groups:
                self._close(layer, group)

    write_stored = write  # snapshots hold q4_kivi rows as float32

    def _close(self, layer: int, group: int) -> None:
        """Round the full open group into its place."""
        g = self.geometry
        keys, values = (np.empty((GROUP, g.kv_width), np.float32) for _ in range(2))
        decode_rows(self.open_keys[layer], FMT_F16, keys)
        decode_rows(self.open_values[layer], FMT_F16, values)
        encode_channels(keys, self.codes[layer, group], self.scales[layer, group], self.mins[layer, group])
        hadamard_rows(values, g.head_dim)
        encode_rows(values, FMT_Q4_0, self.values[layer, group * GROUP : (group + 1) * GROUP])

    def _split(self, end: int) -> tuple[int, int]:
        """Whole groups and open rows of the first `end` positions."""
        closed = min(end // GROUP, self.groups)
        return closed, end - closed * GROUP

    def read(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        g = self.geometry
        closed, n_open = self._split(end)
        keys, values = (np.empty((end, g.kv_width), np.float32) for _ in range(2))
        for group in range(closed):
            rows = slice(group * GROUP, (group + 1) * GROUP)
            at = (layer, group)
            decode_channels(self.codes[at], self.scales[at], self.mins[at], keys[rows])
        decode_rows(self.values[layer, : closed * GROUP], FMT_Q4_0, values[: closed * GROUP])
        hadamard_rows(values[: closed * GROUP], g.head_dim)
        decode_rows(self.open_keys[layer, :n_open], FMT_F16, keys[closed * GROUP :])
        decode_rows(self.open_values[layer, :n_open], FMT_F16, values[closed * GROUP :])
        return keys, values

    stored = read

    def attend(self, layer: int, query: np.ndarray, end: int, start: int = 0) -> np.ndarray:
        if start:
            raise InfernoError("q4_kivi groups keys from position 0: it cannot attend over a sliding window")
        closed, n_open = self._split(end)
        groups = (layer, slice(0, closed))
        return attention_kivi(query, self.codes[groups], self.scales[groups], self.mins[groups],
                              self.values[layer, : closed * GROUP], self.open_keys[layer, :n_open],
                              self.open_values[layer, :n_open], self.geometry.heads)

    def clear(self) -> None:
        pass  # groups and open rows past the cache's length are never read
