"""Numba CPU kernels for one transformer forward: norms, RoPE, softmax, attention, MLP gating.

Every kernel takes float32, C-contiguous arrays (one signature each, so each compiles once and is
cached on disk). Only kernels with enough work per call run in parallel: a decode step's norms and
gates are a few thousand floats, less than the cost of waking a thread pool. Matrix products
against quantized weights live in `inferno.quant`; the big matrix-matrix products of prefill go to
numpy's BLAS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from inferno.jit import njit
from inferno.llvm_ir import declared

# How far ahead of what they read the streaming loops ask for memory (prefetch_ahead): SmolLM2 decode
# measured 3 KiB and 12 KiB no faster than 6 KiB, and a non-temporal hint 2x slower.
PREFETCH_AHEAD = 6144


@intrinsic
def float_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the uint32 `bits`."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def prefetch_ahead(typingctx, array, i):
    """Ask for as many bytes as array[i] holds, PREFETCH_AHEAD bytes past array[i]'s start, into every
    level of the CPU's caches (llvm.prefetch: read, locality 3), a cache line at a time. A kernel
    streaming through an array calls it once per row i it is about to read: with only the CPU's own
    prefetching, weights and cached rows streamed from memory at about half the speed. The addresses
    may lie past the array's end: a prefetch never faults. (Written in IR, not as a jitted loop: that
    added half a second of compiling to every kernel calling it.)"""
    if not isinstance(array, types.Array) or array.layout != "C" or not isinstance(i, types.Integer):
        return None
    sig = types.void(array, i)

    def codegen(context, builder, signature, args):
        struct = context.make_array(signature.args[0])(context, builder, args[0])
        step = cgutils.unpack_tuple(builder, struct.strides)[0]
        row = builder.mul(context.cast(builder, args[1], signature.args[1], types.intp), step)
        byte_pointer, int32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        first = builder.gep(builder.bitcast(struct.data, byte_pointer), [row])
        fetch = declared(builder.module, "llvm.prefetch.p0",
                         ir.FunctionType(ir.VoidType(), [byte_pointer, int32, int32, int32]))
        ahead, line = ir.Constant(step.type, PREFETCH_AHEAD), ir.Constant(step.type, 64)
        with cgutils.for_range_slice(builder, ahead, builder.add(ahead, step), line) as (offset, _):
            at = builder.gep(first, [offset])
            builder.call(fetch, [at, ir.Constant(int32, 0), ir.Constant(int32, 3), ir.Constant(int32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, fastmath=True)
def exp_f32(x: float) -> float:
    """exp of a float32, within 2 ulp of the correctly rounded value, in plain arithmetic that LLVM
    vectorizes (math.exp is a libm call per element: softmax and SiLU spent most of their time in it).

    exp(x) = 2^k * exp(r) with k = round(x / ln 2) and |r| <= ln(2) / 2; exp(r) is Cephes' expf
    polynomial; 2^k is built from its exponent bits. x is clamped to [-87.3, 88]: a normal float32 result.
    """
    x = np.float32(min(max(x, np.float32(-87.33654)), np.float32(88.0)))
    k = np.floor(x * np.float32(1.442695) + np.float32(0.5))
    r = x - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * float_from_bits(np.uint32(np.int32(k) + 127) << 23)


@njit(cache=True, fastmath=True)
def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Rows of x [n, d] scaled to unit root-mean-square, times weight [d]."""
    n, d = x.shape
    out = np.empty_like(x)
    for i in range(n):
        ss = 0.0
        for j in range(d):
            ss += x[i, j] * x[i, j]
        scale = np.float32(1.0 / math.sqrt(ss / d + eps))
        for j in range(d):
            out[i, j] = weight[j] * (x[i, j] * scale)
    return out


@njit(cache=True, fastmath=True)
def rope_single_row(row: np.ndarray, pos: int, n_heads: int, inv_freq: np.ndarray, neox: bool) -> None:
    """Rotate one token's heads in place by the RoPE angles of position `pos`.

    row is [n_heads * head_dim]; inv_freq [rope_dim / 2] holds the rotation frequencies.
    neox pairs dimension i with i + rope_dim/2; otherwise adjacent dimensions (2i, 2i + 1) pair up.
    Dimensions past rope_dim (partial RoPE) are left as they are.
    """
    head_dim = row.shape[0] // n_heads
    half = inv_freq.shape[0]
    for i in range(half):
        angle = np.float32(pos) * inv_freq[i]
        c = np.float32(math.cos(angle))
        s = np.float32(math.sin(angle))
        a_off = i if neox else 2 * i
        b_off = i + half if neox else 2 * i + 1
        for h in range(n_heads):
            a = row[h * head_dim + a_off]
            b = row[h * head_dim + b_off]
            row[h * head_dim + a_off] = a * c - b * s
            row[h * head_dim + b_off] = b * c + a * s


@njit(cache=True, fastmath=True)
def rope(x: np.ndarray, start_pos: int, n_heads: int, inv_freq: np.ndarray, neox: bool) -> None:
    """RoPE in place for a whole sequence x [T, n_heads * head_dim] at positions start_pos.. ."""
    for t in range(x.shape[0]):
        rope_single_row(x[t], start_pos + t, n_heads, inv_freq, neox)


@njit(cache=True, fastmath=True)
def rope_at(x: np.ndarray, positions: np.ndarray, n_heads: int, inv_freq: np.ndarray, neox: bool) -> None:
    """RoPE in place, row t of x [T, n_heads * head_dim] by the angles of positions[t] (int64, may be
    negative). Rotations compose: rotating a row already at position p by d puts it at p + d."""
    for t in range(x.shape[0]):
        rope_single_row(x[t], positions[t], n_heads, inv_freq, neox)


@dataclass(frozen=True)
class Rotary:
    """A model's RoPE, for a cache that moves keys (or queries) to other positions."""

    inv_freq: np.ndarray  # float32 [rope_dim / 2]
    neox: bool

    def rotate(self, x: np.ndarray, n_heads: int, positions: np.ndarray) -> None:
        """Rotate row t of x [T, n_heads * head_dim] in place by positions[t] positions."""
        rope_at(x, positions.astype(np.int64), n_heads, self.inv_freq, self.neox)


@njit(cache=True, fastmath=True)
def rms_norm_heads(x: np.ndarray, n_heads: int, weight: np.ndarray, eps: float) -> None:
    """RMSNorm over each head of each row of x [T, n_heads * head_dim], in place (qwen3's q/k norm)."""
    head_dim = weight.shape[0]
    for t in range(x.shape[0]):
        for h in range(n_heads):
            base = h * head_dim
            ss = 0.0
            for j in range(head_dim):
                ss += x[t, base + j] * x[t, base + j]
            scale = np.float32(1.0 / math.sqrt(ss / head_dim + eps))
            for j in range(head_dim):
                x[t, base + j] = weight[j] * (x[t, base + j] * scale)


MAX_LANES = 16  # running maxima kept side by side in row_max: one zmm register of float32


@njit(cache=True, fastmath=True)
def row_max(x: np.ndarray, lanes: np.ndarray) -> float:
    """The largest value of a non-empty 1-D float32 array; lanes: float32 scratch [MAX_LANES]. A single
    running max() is a chain LLVM keeps scalar (5 cycles a value); MAX_LANES of them side by side are
    one vector max per 16 values."""
    for j in range(MAX_LANES):
        lanes[j] = x[0]
    whole = x.shape[0] - x.shape[0] % MAX_LANES
    for i in range(0, whole, MAX_LANES):
        for j in range(MAX_LANES):
            v = x[i + j]
            lanes[j] = v if v > lanes[j] else lanes[j]
    top = x[0]
    for j in range(MAX_LANES):
        top = lanes[j] if lanes[j] > top else top
    for i in range(whole, x.shape[0]):
        top = x[i] if x[i] > top else top
    return top


@njit(cache=True, fastmath=True)
def softmax(x: np.ndarray) -> None:
    """Softmax of a 1-D array, in place, shifted by its max for stability."""
    m = row_max(x, np.empty(MAX_LANES, np.float32))
    total = np.float32(0.0)
    for i in range(x.shape[0]):
        x[i] = exp_f32(x[i] - m)
        total += x[i]
    inv = np.float32(1.0 / total)
    for i in range(x.shape[0]):
        x[i] *= inv


@njit(cache=True, fastmath=True, parallel=True)
def causal_softmax(scores: np.ndarray, n_queries: int, first_pos: int, window: int) -> None:
    """Masked softmax in place over scores [batch, rows, keys] of a causal attention block.

    Row r belongs to the query at position q = first_pos + r % n_queries, counted from the first key:
    it sees keys q - window + 1 .. q (all of 0 .. q when window is 0) and gets weight exactly 0 on
    every other key.
    """
    batch, rows, _ = scores.shape
    for br in prange(batch * rows):
        b, r = br // rows, br % rows
        visible = first_pos + r % n_queries + 1
        first = max(visible - window, 0) if window > 0 else 0
        scores[b, r, :first] = 0.0
        softmax(scores[b, r, first:visible])
        scores[b, r, visible:] = 0.0


DECODE_SPAN = 128  # most cached positions per parallel task of decode attention
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


@njit(cache=True, fastmath=True)
def score_span(q: np.ndarray, keys: np.ndarray, n_heads: int, weights: np.ndarray, col: int) -> None:
    """weights[h, col + s] = q_h . k_s / sqrt(head_dim) over float32 rows keys [n, kv_width]. Each K row
    is read once, whole, for all heads (1.7x faster than a pass per head once the cache outgrows the
    CPU caches); inner loops run over slices so LLVM vectorizes them."""
    n_pos, kv_width = keys.shape
    head_dim = q.shape[0] // n_heads
    n_kv = kv_width // head_dim
    group = n_heads // n_kv  # query heads h = g * group + i share KV head g
    scale = np.float32(1.0 / math.sqrt(head_dim))
    for s in range(n_pos):
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
    """out[h] += sum_s weights[h, col + s] * v_s over float32 rows values [n, kv_width]."""
    n_pos, kv_width = values.shape
    head_dim = out.shape[0] // n_heads
    n_kv = kv_width // head_dim
    group = n_heads // n_kv
    for s in range(n_pos):
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


@njit(cache=True, fastmath=True, error_model="numpy")
def silu_gate(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SiLU(gate) * up, element-wise, for the gated MLP (rows of [n, ffn]).

    error_model="numpy" drops the per-element zero-divisor check (1 + exp(-g) > 0 anyway), which
    kept LLVM from vectorizing the loop: 10x faster."""
    n, f = gate.shape
    out = np.empty_like(gate)
    for i in range(n):
        for j in range(f):
            g = gate[i, j]
            out[i, j] = g / (np.float32(1.0) + np.float32(exp_f32(-g))) * up[i, j]
    return out


GELU_TANH_C = math.sqrt(2.0 / math.pi)


@njit(cache=True, fastmath=True, error_model="numpy")
def gelu_tanh_gate(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """GELU(gate) * up with GELU's tanh approximation (Gemma's FFN), element-wise over [n, ffn].

    0.5 g (1 + tanh(y)) is g - g / (exp(2y) + 1): the vectorizable exp_f32 instead of a tanh call.
    """
    n, f = gate.shape
    out = np.empty_like(gate)
    c = np.float32(GELU_TANH_C)
    for i in range(n):
        for j in range(f):
            g = gate[i, j]
            y = c * (g + np.float32(0.044715) * g * g * g)
            out[i, j] = (g - g / (np.float32(exp_f32(2 * y)) + np.float32(1.0))) * up[i, j]
    return out


@njit(cache=True)
def concat_dim0(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A new array holding the rows of a then the rows of b: a full copy, by design.

    Explicit loops: an array-to-array slice assignment makes Numba compile its shape-mismatch error
    message (about 2 s of a fresh machine's first run)."""
    out = np.empty((a.shape[0] + b.shape[0], a.shape[1]), dtype=a.dtype)
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[i, j] = a[i, j]
    for i in range(b.shape[0]):
        for j in range(b.shape[1]):
            out[a.shape[0] + i, j] = b[i, j]
    return out


ROWWISE_PAIRS = 1024  # query-key pairs up to which prefill attends one query at a time (see below)


def attention_prefill(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    n_heads: int,
    first_pos: int,
    block: int = 256,
    window: int | None = None,
) -> np.ndarray:
    """Causal grouped-query attention of T new queries at positions first_pos.. over S = first_pos + T keys.

    q [T, n_heads * head_dim]; keys, values [S, n_kv_heads * head_dim]. Positions count from keys[0],
    so keys may begin anywhere in the sequence (a cache holding only a sliding window passes its rows
    with first_pos counted from the oldest). window: each query sees only its last `window` positions,
    itself included (a sliding-window layer); None sees them all. The products are BLAS matmuls per KV
    head, with all query heads of a group stacked; queries go in blocks so the score matrix stays small
    for long prompts, and a block reads only the keys its queries can see.

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
    for t0 in range(0, n_queries, block):
        t1 = min(t0 + block, n_queries)
        n = t1 - t0
        visible = first_pos + t1  # keys past the last query of the block are never seen
        first = max(first_pos + t0 + 1 - window, 0) if window else 0  # nor keys before the first's window
        # [n, n_kv, group, D] -> [n_kv, group * n, D]: each KV head's query heads stacked, scaled as they
        # are copied (D multiplies a query, where scaling its scores took one a visible key)
        q_heads = np.empty((n_kv, group, n, head_dim), np.float32)
        np.multiply(q[t0:t1].reshape(n, n_kv, group, head_dim).transpose(1, 2, 0, 3), scale, out=q_heads)
        scores = np.matmul(q_heads.reshape(n_kv, group * n, head_dim), k_heads[:, :, first:visible])
        causal_softmax(scores, n, first_pos + t0 - first, window or 0)
        mixed = np.matmul(scores, v_heads[:, first:visible])  # [n_kv, group * n, D]
        out[t0:t1] = mixed.reshape(n_kv, group, n, head_dim).transpose(2, 0, 1, 3).reshape(n, -1)
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
