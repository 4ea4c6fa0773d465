"""Numba CPU kernels of attention: decode's spans done in parallel and combined, prefill's blocks of
queries through BLAS, a sliding window with sinks.

The same contract as inferno.kernels.ops: float32, C-contiguous arrays, one signature each.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from inferno.kernels.attention_tiles import TILE, mix_tile, score_tile
from inferno.kernels.jit import njit
from inferno.kernels.llvm_ir import prefetch_ahead, prefetch_row
from inferno.kernels.ops import MAX_LANES, causal_softmax, exp_f32, row_max
from inferno.kernels.sharing import dealt

DECODE_SPAN = 128  # most cached positions per parallel task of decode attention
TILE_AHEAD = 64  # rows ahead of a tile its kernels ask memory for (attention_tiles)
MIN_SPAN = 16  # fewest: below this a task costs more to hand out than its positions take


def decode_span(n_pos: int) -> int:
    """Positions per parallel task when one query attends over n_pos: at most DECODE_SPAN, and short
    enough that every thread gets a span when the cache is short (at depth 100, one span of 128 ran
    the whole attention on one thread). Computed at each call, outside the kernels: a thread count
    compiled into a cached kernel stays the count of whichever run compiled it."""
    spans = max(-(-n_pos // DECODE_SPAN), min(numba.config.NUMBA_NUM_THREADS, n_pos // MIN_SPAN))
    return max(-(-n_pos // max(spans, 1)), 1)


@njit(cache=True, fastmath=True)
def attend_span(q: np.ndarray, keys: np.ndarray, values: np.ndarray, n_heads: int, weights: np.ndarray,
                out: np.ndarray, stats: np.ndarray) -> None:
    """One query token over a span of cached rows, softmax left unnormalised (flash-decoding).

    For each query head h: out[h] = sum_s exp(score_s - m) * v_s, stats[h] = (m, sum_s exp(score_s - m))
    with m the span's largest score, so spans combine exactly (see combine_spans). weights: scratch
    [heads, span].
    """
    score_span(q, keys, n_heads, weights, 0)
    mix_span(weights, values, n_heads, out, stats)


@njit(cache=True)
def _first_tiles(rows: np.ndarray, head_dim: int) -> int:
    """How many of the rows [n, kv_width] go through the tile kernels (whole tiles, when a head is whole
    vectors; else none), their first TILE_AHEAD rows asked for (each tile asks TILE_AHEAD past its own)."""
    n_pos = rows.shape[0]
    tiled = n_pos - n_pos % TILE if head_dim % TILE == 0 else 0
    for s in range(min(TILE_AHEAD, tiled)):
        prefetch_row(rows, s)
    return tiled


@njit(cache=True, fastmath=True)
def score_span(q: np.ndarray, keys: np.ndarray, n_heads: int, weights: np.ndarray, col: int) -> None:
    """weights[h, col + s] = q_h . k_s / sqrt(head_dim) over float32 rows keys [n, kv_width]: TILE rows at
    a time (attention_tiles.score_tile), the last n % TILE one at a time, each read once, whole, for all
    heads (inner loops over slices, which LLVM vectorizes)."""
    n_pos, kv_width = keys.shape
    head_dim = q.shape[0] // n_heads
    n_kv = kv_width // head_dim
    group = n_heads // n_kv  # query heads h = g * group + i share KV head g
    scale = np.float32(1.0 / math.sqrt(head_dim))
    width = weights.shape[1]
    tiled = _first_tiles(keys, head_dim)
    for s0 in range(0, tiled, TILE):
        for g in range(n_kv):
            score_tile(q, g * group * head_dim, keys, s0 * kv_width + g * head_dim, kv_width, group, head_dim,
                       weights, g * group * width + col + s0, width, scale, TILE_AHEAD * kv_width)
    for s in range(tiled, n_pos):
        prefetch_ahead(keys, s)
        for g in range(n_kv):
            kh = keys[s, g * head_dim : (g + 1) * head_dim]
            for h in range(g * group, (g + 1) * group):
                qh = q[h * head_dim : (h + 1) * head_dim]
                acc = np.float32(0.0)
                for j in range(head_dim):
                    acc += qh[j] * kh[j]
                weights[h, col + s] = acc * scale


@njit(cache=True, fastmath=True)
def mix_span(weights: np.ndarray, values: np.ndarray, n_heads: int, out: np.ndarray,
             stats: np.ndarray) -> None:
    """The second half of attend_span, given the span's scaled scores weights [heads, n_pos]: the
    unnormalised softmax of each head's scores (and its stats) and the values mixed by it."""
    softmax_span(weights, values.shape[0], stats)
    out[:] = 0.0
    mix_values(weights, values, n_heads, out, 0)


@njit(cache=True, fastmath=True)
def mix_values(weights: np.ndarray, values: np.ndarray, n_heads: int, out: np.ndarray, col: int) -> None:
    """out[h] += sum_s weights[h, col + s] * v_s over float32 rows values [n, kv_width]: TILE rows at a
    time (attention_tiles.mix_tile), the last n % TILE one at a time."""
    n_pos, kv_width = values.shape
    head_dim = out.shape[0] // n_heads
    n_kv = kv_width // head_dim
    group = n_heads // n_kv
    width = weights.shape[1]
    tiled = _first_tiles(values, head_dim)
    for s0 in range(0, tiled, TILE):
        for g in range(n_kv):
            mix_tile(weights, g * group * width + col + s0, width, values, s0 * kv_width + g * head_dim,
                     kv_width, group, head_dim, out, g * group * head_dim, TILE_AHEAD * kv_width)
    for s in range(tiled, n_pos):
        prefetch_ahead(values, s)
        for g in range(n_kv):
            vh = values[s, g * head_dim : (g + 1) * head_dim]
            for h in range(g * group, (g + 1) * group):
                w = weights[h, col + s]
                oh = out[h * head_dim : (h + 1) * head_dim]
                for j in range(head_dim):
                    oh[j] += w * vh[j]


@njit(cache=True, fastmath=True)
def softmax_span(weights: np.ndarray, n_pos: int, stats: np.ndarray) -> None:
    """exp(score - max) of each head's first n_pos scores in place, stats[h] = (max, sum)."""
    lanes = np.empty(MAX_LANES, np.float32)
    for h in range(weights.shape[0]):
        wh = weights[h, :n_pos]
        top = row_max(wh, lanes)  # not wh.max(): numpy's max costs a second of first compile
        total = np.float32(0.0)
        for s in range(n_pos):
            wh[s] = exp_f32(wh[s] - top)
            total += wh[s]
        stats[h, 0] = top
        stats[h, 1] = total


def attention_decode(q: np.ndarray, keys: np.ndarray, values: np.ndarray, n_heads: int) -> np.ndarray:
    """One query token against every cached position, grouped-query heads; no mask is needed.

    q [n_heads * head_dim]; keys, values [S, n_kv_heads * head_dim]; returns [n_heads * head_dim].
    The positions are cut into spans (decode_span) done in parallel, each reading its K and V rows
    once; the spans' partial softmaxes are then rescaled to the global maximum and summed. This is
    the one decode-attention kernel of every cache layout and element type (blocks.attend_tables):
    here over float32 rows stored in order.
    """
    from inferno.kv.blocks import attend_rows  # it imports this module's pieces

    return attend_rows(q, keys, values, 0, keys.shape[0], n_heads)


@njit(cache=True, fastmath=True)
def combine_spans(partial: np.ndarray, stats: np.ndarray, n_heads: int) -> np.ndarray:
    """The attention output from spans' unnormalised parts partial [spans, heads * head_dim] and their
    stats [spans, heads, (max score, sum of exp)]: each rescaled to the global maximum, summed, normalised."""
    out = np.empty(partial.shape[1], np.float32)
    combine_spans_into(partial, stats, n_heads, out)
    return out


@njit(cache=True, fastmath=True)
def combine_spans_into(partial: np.ndarray, stats: np.ndarray, n_heads: int, out: np.ndarray) -> None:
    """combine_spans written into out [heads * head_dim] (a row of a batch's output: no array of its own
    to allocate and copy)."""
    n_spans, width = partial.shape
    head_dim = width // n_heads
    for h in range(n_heads):
        top = stats[0, h, 0]
        for c in range(1, n_spans):
            top = max(top, stats[c, h, 0])
        total = np.float32(0.0)
        oh = out[h * head_dim : (h + 1) * head_dim]
        for j in range(head_dim):
            oh[j] = 0.0
        for c in range(n_spans):
            rescale = np.float32(exp_f32(stats[c, h, 0] - top))
            total += rescale * stats[c, h, 1]
            ph = partial[c, h * head_dim : (h + 1) * head_dim]
            for j in range(head_dim):
                oh[j] += rescale * ph[j]
        inv = np.float32(1.0) / total
        for j in range(head_dim):
            oh[j] *= inv


ROWWISE_PAIRS = 1024  # query-key pairs up to which prefill attends one query at a time (see below)


def attention_prefill(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    n_heads: int,
    first_pos: int,
    block: int = 64,
    window: int | None = None,
) -> np.ndarray:
    """Causal grouped-query attention of T new queries at positions first_pos.. over S = first_pos + T keys.

    q [T, n_heads * head_dim]; keys, values [S, n_kv_heads * head_dim]. Positions count from keys[0],
    so keys may begin anywhere in the sequence (a cache holding only a sliding window passes its rows
    with first_pos counted from the oldest). window: each query sees only its last `window` positions,
    itself included (a sliding-window layer); None sees them all. The products are BLAS matmuls per KV
    head, with all query heads of a group stacked; queries go in blocks so the score matrix stays small
    for long prompts, and a block reads only the keys its queries can see. Each KV head's block is one
    item of work for the threads (kernels.sharing.dealt), dealt by its cost.

    A short prompt on a short cache (ROWWISE_PAIRS) takes each query through decode's kernel over the
    keys it sees: such prefill then compiles nothing of its own, 0.6 s less on a fresh machine's first
    run, and a long prompt compiles the blocks' softmax when it comes.
    """
    n_queries = q.shape[0]
    n_pos, kv_width = keys.shape
    if n_queries * n_pos <= ROWWISE_PAIRS:
        rows = np.empty_like(q)
        for t in range(n_queries):
            end = first_pos + t + 1
            start = max(end - window, 0) if window else 0
            rows[t] = attention_decode(q[t], keys[start:end], values[start:end], n_heads)
        return rows
    head_dim = q.shape[1] // n_heads
    n_kv = kv_width // head_dim
    group = n_heads // n_kv
    k_heads = keys.reshape(n_pos, n_kv, head_dim).transpose(1, 2, 0)  # [n_kv, D, S], a view
    v_heads = values.reshape(n_pos, n_kv, head_dim).transpose(1, 0, 2)  # [n_kv, S, D], a view
    out = np.empty_like(q)
    scale = np.float32(1.0 / math.sqrt(head_dim))
    # a block of queries t0..t1 sees keys first..visible: none past its last query, none before its
    # first's window; each KV head's block is one unit of work
    blocks = [(t0, min(t0 + block, n_queries)) for t0 in range(0, n_queries, block)]
    units = [(h, t0, t1, max(first_pos + t0 + 1 - window, 0) if window else 0, first_pos + t1)
             for t0, t1 in blocks for h in range(n_kv)]

    def attend(unit: int) -> None:
        h, t0, t1, first, visible = units[unit]
        n = t1 - t0
        # [n, group, D] -> [group * n, D]: the KV head's query heads stacked, scaled as they are copied
        # (D multiplies a query, where scaling its scores took one a visible key)
        q_heads = np.empty((group, n, head_dim), np.float32)
        np.multiply(q[t0:t1].reshape(n, n_kv, group, head_dim)[:, h].transpose(1, 0, 2), scale, out=q_heads)
        scores = q_heads.reshape(group * n, head_dim) @ k_heads[h, :, first:visible]
        inverse_sums = np.empty((group * n, 1), np.float32)
        causal_softmax(scores, n, first_pos + t0 - first, window or 0, inverse_sums[:, 0])
        mixed = scores @ v_heads[h, first:visible]  # [group * n, D]
        mixed *= inverse_sums
        rows = out[t0:t1].reshape(n, n_kv, group, head_dim)
        rows[:, h] = mixed.reshape(group, n, head_dim).transpose(1, 0, 2)

    # a unit's cost: its query-key pairs, each a multiply-add of D in both products for each query head
    dealt(attend, [(t1 - t0) * (visible - first) for _, t0, t1, first, visible in units],
          flop_per_cost=4 * group * head_dim)
    return out


def attention_window(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    key_pos: np.ndarray,
    first_pos: int,
    n_heads: int,
    window: int,
    sinks: int,
    q_sinks: np.ndarray | None = None,
    block: int = 256,
) -> np.ndarray:
    """Sliding-window attention (StreamingLLM) of T queries at positions first_pos.. over rows held at
    key_pos (any order): the query at t sees the keys at p <= t with p < sinks or p > t - window.

    q [T, n_heads * head_dim]; keys, values [S, kv_width]; key_pos int [S]. q_sinks, when given,
    replaces q in the scores against the sink rows (p < sinks): queries rotated to another position.
    Queries go in blocks, each over only the keys some query of the block can see.
    """
    n_queries = q.shape[0]
    kv_width = keys.shape[1]
    head_dim = q.shape[1] // n_heads
    n_kv = kv_width // head_dim
    group = n_heads // n_kv
    scale = np.float32(1.0 / math.sqrt(head_dim))
    out = np.empty_like(q)

    def by_head(x: np.ndarray, n: int) -> np.ndarray:  # [n, n_kv, group, D] -> [n_kv, group * n, D]
        return x.reshape(n, n_kv, group, head_dim).transpose(1, 2, 0, 3).reshape(n_kv, group * n, head_dim)

    for t0 in range(0, n_queries, block):
        t1 = min(t0 + block, n_queries)
        n = t1 - t0
        q_at = first_pos + np.arange(t0, t1)
        near = (key_pos < sinks) | ((key_pos > q_at[0] - window) & (key_pos <= q_at[-1]))
        pos = key_pos[near]
        k_heads = keys[near].reshape(-1, n_kv, head_dim).transpose(1, 2, 0)  # [n_kv, D, m]
        v_heads = values[near].reshape(-1, n_kv, head_dim).transpose(1, 0, 2)  # [n_kv, m, D]
        scores = np.matmul(by_head(q[t0:t1], n), k_heads) * scale  # [n_kv, group * n, m]
        is_sink = pos < sinks
        if q_sinks is not None and is_sink.any():
            scores[:, :, is_sink] = np.matmul(by_head(q_sinks[t0:t1], n), k_heads[:, :, is_sink]) * scale
        seen = (pos[None, :] <= q_at[:, None]) & (is_sink[None, :] | (pos[None, :] > q_at[:, None] - window))
        scores = np.where(np.tile(seen, (group, 1))[None], scores, -np.inf)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        mixed = np.matmul(scores.astype(np.float32), v_heads)  # [n_kv, group * n, D]
        out[t0:t1] = mixed.reshape(n_kv, group, n, head_dim).transpose(2, 0, 1, 3).reshape(n, -1)
    return out
