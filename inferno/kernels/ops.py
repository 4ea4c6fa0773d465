"""Numba CPU kernels of one transformer forward that are not attention: RMSNorm (alone and after the
residual add), RoPE, softmax, the MLP's gating, a copy of rows.

Every kernel takes float32, C-contiguous arrays (one signature each, so each compiles once and is
cached on disk). Only kernels with enough work per call run in parallel: a decode step's norms and
gates are a few thousand floats, less than the cost of waking a thread pool. Matrix products
against quantized weights live in `inferno.kernels.quant`; the big matrix-matrix products of prefill
go to numpy's BLAS.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from inferno.kernels.jit import njit
from inferno.kernels.llvm_ir import float_from_bits
from inferno.kernels.sharing import in_spans, threads_for


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


@njit(cache=True, fastmath=True, inline="always")
def _normed_row(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out = x [d] scaled to unit root-mean-square, times weight [d]."""
    d = x.shape[0]
    ss = 0.0
    for j in range(d):
        ss += x[j] * x[j]
    scale = np.float32(1.0 / math.sqrt(ss / d + eps))
    for j in range(d):
        out[j] = weight[j] * (x[j] * scale)


@njit(cache=True, fastmath=True)
def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Rows of x [n, d] scaled to unit root-mean-square, times weight [d]."""
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        _normed_row(x[i], weight, eps, out[i])
    return out


@njit(cache=True, fastmath=True)
def add_rmsnorm(x: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x += delta in place (the residual stream taking a block's output, [n, d]), and returns
    rmsnorm(x, weight, eps) of the sum: the next block's input, in one call instead of two."""
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            x[i, j] += delta[i, j]
        _normed_row(x[i], weight, eps, out[i])
    return out


@njit(cache=True, fastmath=True)
def rotations(positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """The RoPE rotation of each position: float32 [T, 2, rope_dim / 2], the cosines then the sines of
    its angles (position t, dimension pair i: positions[t] * inv_freq[i], in float32 as HF computes
    them). A forward computes them once, for every layer of one RoPE base."""
    out = np.empty((positions.shape[0], 2, inv_freq.shape[0]), np.float32)
    for t in range(positions.shape[0]):
        for i in range(inv_freq.shape[0]):
            angle = np.float32(positions[t]) * inv_freq[i]
            out[t, 0, i] = np.float32(math.cos(angle))
            out[t, 1, i] = np.float32(math.sin(angle))
    return out


@njit(cache=True, fastmath=True)
def rotate(x: np.ndarray, turns: np.ndarray, n_heads: int, neox: bool) -> None:
    """RoPE in place: row t of x [T, n_heads * head_dim] turned by turns[t] (`rotations`).

    neox pairs dimension i with i + rope_dim/2; otherwise adjacent dimensions (2i, 2i + 1) pair up.
    Dimensions past rope_dim (partial RoPE) are left as they are."""
    head_dim = x.shape[1] // n_heads
    half = turns.shape[2]
    for t in range(x.shape[0]):
        cos, sin = turns[t, 0], turns[t, 1]
        for h in range(n_heads):
            row = x[t, h * head_dim : (h + 1) * head_dim]
            if neox:  # a loop of its own each: constant strides, which LLVM vectorizes
                first, second = row[:half], row[half : 2 * half]
                for i in range(half):
                    a, b = first[i], second[i]
                    first[i] = a * cos[i] - b * sin[i]
                    second[i] = b * cos[i] + a * sin[i]
            else:
                for i in range(half):
                    a, b = row[2 * i], row[2 * i + 1]
                    row[2 * i] = a * cos[i] - b * sin[i]
                    row[2 * i + 1] = b * cos[i] + a * sin[i]


def rope(x: np.ndarray, start_pos: int, n_heads: int, inv_freq: np.ndarray, neox: bool) -> None:
    """RoPE in place for a whole sequence x [T, n_heads * head_dim] at positions start_pos.. ."""
    rope_at(x, np.arange(start_pos, start_pos + x.shape[0], dtype=np.int64), n_heads, inv_freq, neox)


def rope_at(x: np.ndarray, positions: np.ndarray, n_heads: int, inv_freq: np.ndarray, neox: bool) -> None:
    """RoPE in place, row t of x [T, n_heads * head_dim] by the angles of positions[t] (int64, may be
    negative). Rotations compose: rotating a row already at position p by d puts it at p + d."""
    rotate(x, rotations(positions, inv_freq), n_heads, neox)


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
            head = x[t, h * head_dim : (h + 1) * head_dim]
            _normed_row(head, weight, eps, head)


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


@njit(cache=True, fastmath=True, nogil=True)
def causal_softmax(scores: np.ndarray, n_queries: int, first_pos: int, window: int, inverse_sums: np.ndarray
                   ) -> None:
    """Masked softmax over scores [rows, keys] of a causal attention block, in the calling thread (a
    share of kernels.sharing's: several run at once), left unnormalised: each row becomes exp(score -
    its max), and inverse_sums[row] what to multiply it by, which the caller does to the far smaller
    product of the weights and the values.

    Row r belongs to the query at position q = first_pos + r % n_queries, counted from the first key:
    it sees keys q - window + 1 .. q (all of 0 .. q when window is 0) and gets weight exactly 0 on
    every other key.
    """
    lanes = np.empty(MAX_LANES, np.float32)
    for r in range(scores.shape[0]):
        visible = first_pos + r % n_queries + 1
        first = max(visible - window, 0) if window > 0 else 0
        scores[r, :first] = 0.0
        seen = scores[r, first:visible]
        top = row_max(seen, lanes)
        total = np.float32(0.0)
        for i in range(seen.shape[0]):
            e = exp_f32(seen[i] - top)
            seen[i] = e
            total += e
        inverse_sums[r] = np.float32(1.0) / total
        scores[r, visible:] = 0.0


@njit(cache=True, fastmath=True, error_model="numpy", nogil=True)
def silu_gate(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """out = SiLU(gate) * up, element-wise, for the gated MLP (rows of [n, ffn]).

    error_model="numpy" drops the per-element zero-divisor check (1 + exp(-g) > 0 anyway), which
    kept LLVM from vectorizing the loop: 10x faster."""
    n, f = gate.shape
    for i in range(n):
        for j in range(f):
            g = gate[i, j]
            out[i, j] = g / (np.float32(1.0) + np.float32(exp_f32(-g))) * up[i, j]


GELU_TANH_C = math.sqrt(2.0 / math.pi)


@njit(cache=True, fastmath=True, error_model="numpy", nogil=True)
def gelu_tanh_gate(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """out = GELU(gate) * up with GELU's tanh approximation (Gemma's FFN), element-wise over [n, ffn].

    0.5 g (1 + tanh(y)) is g - g / (exp(2y) + 1): the vectorizable exp_f32 instead of a tanh call.
    """
    n, f = gate.shape
    c = np.float32(GELU_TANH_C)
    for i in range(n):
        for j in range(f):
            g = gate[i, j]
            y = c * (g + np.float32(0.044715) * g * g * g)
            out[i, j] = (g - g / (np.float32(exp_f32(2 * y)) + np.float32(1.0))) * up[i, j]


GATE_FLOP = 20  # float operations a gated value takes, the exponential counted as a dozen


def gated(activation: Callable[[np.ndarray, np.ndarray, np.ndarray], None], gate: np.ndarray,
          up: np.ndarray) -> np.ndarray:
    """activation(gate, up) of rows [n, ffn] (silu_gate, gelu_tanh_gate): a long prefill's rows in
    spans, one per thread (kernels.sharing)."""
    out, flop = np.empty_like(gate), GATE_FLOP * gate.size
    if threads_for(len(gate), flop) == 1:  # decode, a short prompt: here, without the sharing's bookkeeping
        activation(gate, up, out)
    else:
        in_spans(lambda lo, hi: activation(gate[lo:hi], up[lo:hi], out[lo:hi]), len(gate), flop)
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
