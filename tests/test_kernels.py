"""Kernels against plain numpy written from the definitions."""

import collections
import math
import threading

import numba
import numpy as np
import pytest
from numba import njit
from threadpoolctl import threadpool_info

from inferno.file.config import ModelConfig
from inferno.kernels import attention, attention_tiles, llvm_ir, ops, sharing
from inferno.model.transformer import rope_frequencies

rng = np.random.default_rng(0)


def reference_rope(x: np.ndarray, positions, n_heads: int, inv_freq: np.ndarray, neox: bool) -> np.ndarray:
    t, width = x.shape
    d = width // n_heads
    half = len(inv_freq)
    out = x.astype(np.float64).reshape(t, n_heads, d)
    angles = np.outer(positions, inv_freq.astype(np.float64))
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    a_idx = np.arange(half) if neox else 2 * np.arange(half)
    b_idx = a_idx + half if neox else a_idx + 1
    a, b = out[:, :, a_idx].copy(), out[:, :, b_idx].copy()
    out[:, :, a_idx] = a * cos - b * sin
    out[:, :, b_idx] = b * cos + a * sin
    return out.reshape(t, width)


def config(rope_dim: int = 16, neox: bool = False) -> ModelConfig:
    return ModelConfig(
        architecture="llama", n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, hidden_size=64,
        ffn_size=128, vocab_size=10, rope_base=10000.0, rope_dim=rope_dim, rope_neox=neox, rms_eps=1e-5,
        context_length=4096, tied_embeddings=True, qkv_bias=False, qk_norm=False, bos_id=None, eos_id=None,
    )


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("rope_dim", [16, 8])  # 8: partial RoPE leaves the tail dimensions alone
def test_rope_matches_the_definition(neox, rope_dim):
    inv_freq = rope_frequencies(config(rope_dim, neox))
    x = rng.standard_normal((40, 64), dtype=np.float32)
    got = x.copy()
    ops.rope(got, 1000, 4, inv_freq, neox)
    want = reference_rope(x, np.arange(1000, 1040), 4, inv_freq, neox)
    np.testing.assert_allclose(got, want, atol=2e-4)
    if rope_dim < 16:
        tail = np.s_[:, :, rope_dim:]
        np.testing.assert_array_equal(got.reshape(40, 4, 16)[tail], x.reshape(40, 4, 16)[tail])


def rope_by_definition(row: np.ndarray, pos: int, n_heads: int, rope_dim: int, base: float, neox: bool):
    """RoPE as defined: in each head, pair j (dimensions j and j + rope_dim/2 for NEOX, 2j and 2j + 1
    otherwise) is the complex number x_a + i x_b, multiplied by e^(i pos theta_j), theta_j =
    base^(-2j / rope_dim); dimensions past rope_dim stay."""
    heads = row.astype(np.float64).reshape(n_heads, -1).copy()
    j = np.arange(rope_dim // 2)
    a, b = (j, j + rope_dim // 2) if neox else (2 * j, 2 * j + 1)
    z = (heads[:, a] + 1j * heads[:, b]) * np.exp(1j * pos * base ** (-2 * j / rope_dim))
    heads[:, a], heads[:, b] = z.real, z.imag
    return heads.reshape(-1)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("rope_dim", [16, 8])
def test_rope_is_the_rotation_of_the_definition(neox, rope_dim):
    inv_freq = (10000.0 ** (-np.arange(0, rope_dim, 2) / rope_dim)).astype(np.float32)
    np.testing.assert_allclose(rope_frequencies(config(rope_dim, neox)), inv_freq, rtol=1e-6)
    x = rng.standard_normal(64, dtype=np.float32)
    for pos in (0, 1, 17, 299, 4000):
        row = x.copy()
        ops.rope_at(row[None], np.array([pos]), 4, inv_freq, neox)
        np.testing.assert_allclose(row, rope_by_definition(x, pos, 4, rope_dim, 10000.0, neox), atol=2e-3)
    assert not np.allclose(row, rope_by_definition(x, 4000, 4, rope_dim, 10000.0, not neox), atol=0.1)


def test_rmsnorm():
    x = rng.standard_normal((5, 64), dtype=np.float32)
    w = rng.standard_normal(64, dtype=np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(ops.rmsnorm(x, w, 1e-5), want, rtol=1e-5, atol=1e-6)


def test_add_rmsnorm_is_the_residual_add_then_the_norm_bit_for_bit():
    x = rng.standard_normal((3, 960), dtype=np.float32)
    delta = rng.standard_normal((3, 960), dtype=np.float32)
    w = rng.standard_normal(960, dtype=np.float32)
    total = x + delta
    normed = ops.add_rmsnorm(x, delta, w, 1e-6)
    np.testing.assert_array_equal(x, total)  # the residual stream took the block's output in place
    np.testing.assert_array_equal(normed, ops.rmsnorm(total, w, 1e-6))


def test_rms_norm_heads_normalises_each_head_alone():
    x = rng.standard_normal((3, 4 * 16), dtype=np.float32)
    w = rng.standard_normal(16, dtype=np.float32)
    got = x.copy()
    ops.rms_norm_heads(got, 4, w, 1e-6)
    heads = x.reshape(3, 4, 16).astype(np.float64)
    want = heads / np.sqrt((heads**2).mean(axis=2, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, want.reshape(3, 64), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("rows", "shared_from"), [(2, math.inf), (40, 0)])  # alone; rows in spans of threads
def test_silu_gate(rows, shared_from, monkeypatch):
    monkeypatch.setattr(sharing, "SHARED_FROM_FLOP", shared_from)
    g = rng.standard_normal((rows, 50), dtype=np.float32)
    u = rng.standard_normal((rows, 50), dtype=np.float32)
    np.testing.assert_allclose(ops.gated(ops.silu_gate, g, u), g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("rows", "shared_from"), [(2, math.inf), (40, 0)])
def test_gelu_tanh_gate(rows, shared_from, monkeypatch):
    monkeypatch.setattr(sharing, "SHARED_FROM_FLOP", shared_from)
    g = rng.standard_normal((rows, 50), dtype=np.float32) * 4
    u = rng.standard_normal((rows, 50), dtype=np.float32)
    x = g.astype(np.float64)
    want = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))) * u
    np.testing.assert_allclose(ops.gated(ops.gelu_tanh_gate, g, u), want, rtol=1e-5, atol=1e-6)


def test_concat_dim0_copies_rows_in_order():
    a = rng.standard_normal((3, 4), dtype=np.float32)
    b = rng.standard_normal((1, 4), dtype=np.float32)
    out = ops.concat_dim0(a, b)
    np.testing.assert_array_equal(out, np.concatenate([a, b]))
    assert not np.shares_memory(out, a)


def reference_attention(q, k, v, n_heads, first_pos, window=None):
    """Causal grouped-query attention in float64, one head at a time; with a window, the query at
    position p sees keys p - window + 1 .. p (transformers' sliding-window mask)."""
    t, width = q.shape
    d = width // n_heads
    group = n_heads // (k.shape[1] // d)
    out = np.zeros((t, width))
    for h in range(n_heads):
        g = h // group
        qh, kh, vh = q[:, h * d:(h + 1) * d], k[:, g * d:(g + 1) * d], v[:, g * d:(g + 1) * d]
        scores = qh.astype(np.float64) @ kh.T / math.sqrt(d)
        for i in range(t):
            end = first_pos + i + 1
            start = max(end - window, 0) if window else 0
            s = scores[i, start:end]
            p = np.exp(s - s.max())
            out[i, h * d:(h + 1) * d] = (p / p.sum()) @ vh[start:end]
    return out


@pytest.mark.parametrize("t", [3, 300])  # a query at a time (attention.ROWWISE_PAIRS); over query blocks
@pytest.mark.parametrize("first_pos", [0, 13])
@pytest.mark.parametrize("shared_from", [math.inf, 0])  # the blocks in this thread; dealt to the threads
def test_attention_prefill_is_causal_grouped_query_attention(first_pos, t, shared_from, monkeypatch):
    monkeypatch.setattr(sharing, "SHARED_FROM_FLOP", shared_from)
    s = first_pos + t
    q = rng.standard_normal((t, 8 * 16), dtype=np.float32)
    k = rng.standard_normal((s, 2 * 16), dtype=np.float32)
    v = rng.standard_normal((s, 2 * 16), dtype=np.float32)
    got = attention.attention_prefill(q, k, v, 8, first_pos)
    np.testing.assert_allclose(got, reference_attention(q, k, v, 8, first_pos), atol=1e-5)


@pytest.mark.parametrize("t", [3, 300])
@pytest.mark.parametrize(("first_pos", "window"), [(0, 1), (0, 37), (13, 100), (290, 512), (0, 1000)])
def test_attention_prefill_sees_only_the_window(first_pos, window, t, monkeypatch):
    monkeypatch.setattr(sharing, "SHARED_FROM_FLOP", 0)  # the blocks dealt to the threads
    s = first_pos + t
    q = rng.standard_normal((t, 4 * 16), dtype=np.float32)
    k = rng.standard_normal((s, 1 * 16), dtype=np.float32)
    v = rng.standard_normal((s, 1 * 16), dtype=np.float32)
    got = attention.attention_prefill(q, k, v, 4, first_pos, window=window)
    np.testing.assert_allclose(got, reference_attention(q, k, v, 4, first_pos, window), atol=1e-5)
    if window == 1:  # each query sees only itself
        np.testing.assert_allclose(got, np.tile(v, 4), atol=1e-6)


def test_attention_prefill_multiplies_with_blas_on_one_thread_per_share(monkeypatch):
    # BLAS's own threads would spin against the shares' (inferno.kernels.sharing): each block's softmax
    # runs between its two products, so what it sees is what they ran with
    blas_threads = []
    softmax = attention.causal_softmax

    def spy(*args):
        blas_threads.append({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
        softmax(*args)

    monkeypatch.setattr(attention, "causal_softmax", spy)
    monkeypatch.setattr(sharing, "SHARED_FROM_FLOP", 0)
    q = rng.standard_normal((300, 8 * 16), dtype=np.float32)
    k = rng.standard_normal((300, 2 * 16), dtype=np.float32)
    attention.attention_prefill(q, k, k, 8, 0)
    assert blas_threads == [{1}] * (2 * 5)  # 2 KV heads x 5 blocks of 64 queries


def test_shares_started_from_inside_a_share_run_in_its_thread(monkeypatch):
    monkeypatch.setattr(sharing, "threads_for", lambda n, flop=0: min(n, 2))
    ran = []

    def outer(i: int) -> None:
        sharing.in_spans(lambda lo, hi: ran.append((i, lo, hi, threading.get_ident())), 4)

    sharing.dealt(outer, [1, 1])  # every helper is busy running a share: a nested submit would wait forever
    assert sorted(r[:3] for r in ran) == [(0, 0, 2), (0, 2, 4), (1, 0, 2), (1, 2, 4)]


def test_dealt_runs_every_item_once_with_the_threads_evenly_loaded(monkeypatch):
    monkeypatch.setattr(sharing, "threads_for", lambda n, flop=0: min(n, 2))
    ran = collections.defaultdict(list)  # thread -> the items it ran, in order
    costs = [1, 4, 2, 3]
    sharing.dealt(lambda i: ran[threading.get_ident()].append(i), costs)
    assert sorted(i for items in ran.values() for i in items) == [0, 1, 2, 3]
    assert sorted(sum(costs[i] for i in items) for items in ran.values()) == [5, 5]  # {1, 4} and {2, 3}
    assert all(items == sorted(items) for items in ran.values())


@pytest.mark.parametrize("s", [1, 15, 16, 50, 128, 129, 300])  # one span, one per thread, several
def test_attention_decode_is_the_last_row_of_causal_attention(s):
    q = rng.standard_normal((1, 8 * 16), dtype=np.float32)
    k = rng.standard_normal((s, 2 * 16), dtype=np.float32)
    v = rng.standard_normal((s, 2 * 16), dtype=np.float32)
    got = attention.attention_decode(q[0], k, v, 8)
    np.testing.assert_allclose(got, reference_attention(q, k, v, 8, s - 1)[0], atol=1e-5)


# (query heads, KV heads, head_dim): the four models' shapes (the 1.5B's, SmolLM2's, Gemma 3's, the
# 0.5B's), and a head_dim no tile divides (its rows one at a time)
@pytest.mark.parametrize("heads,kv_heads,head_dim",
                         [(12, 2, 128), (9, 3, 64), (4, 1, 256), (14, 2, 64), (6, 2, 24)])
@pytest.mark.parametrize("s", [16, 47, 200])  # whole tiles; tiles and single rows; several spans
def test_attention_decode_of_model_shapes_in_tiles_and_single_rows(heads, kv_heads, head_dim, s):
    q = rng.standard_normal((1, heads * head_dim), dtype=np.float32)
    k = rng.standard_normal((s, kv_heads * head_dim), dtype=np.float32)
    v = rng.standard_normal((s, kv_heads * head_dim), dtype=np.float32)
    got = attention.attention_decode(q[0], k, v, heads)
    np.testing.assert_allclose(got, reference_attention(q, k, v, heads, s - 1)[0], atol=2e-5)


@pytest.mark.parametrize("tile", [8, 16])  # the two widths the module compiles for (AVX2, AVX-512)
def test_tile_kernels_at_either_vector_width(tile, monkeypatch):
    """score_tile and mix_tile against their definitions, on rows strided as a cache's, at a width set
    before they compile (TILE is read as their IR is built)."""
    monkeypatch.setattr(attention_tiles, "TILE", tile)
    heads, head_dim, stride = 3, 4 * tile, 6 * tile  # a KV head's 3 query heads; rows wider than a head
    q = rng.standard_normal(heads * head_dim, dtype=np.float32)
    rows = rng.standard_normal((tile + 2, stride), dtype=np.float32)
    weights = rng.standard_normal((heads, tile + 5), dtype=np.float32)

    @njit
    def tiles(q, rows, weights, out):
        scores = np.zeros((heads, tile + 5), np.float32)
        attention_tiles.score_tile(q, 0, rows, stride + tile, stride, heads, head_dim, scores, 2, tile + 5,
                                   np.float32(0.5), 2 * stride)
        attention_tiles.mix_tile(weights, 3, tile + 5, rows, stride + tile, stride, heads, head_dim, out, 0,
                                 2 * stride)
        return scores

    seen = rows[1 : 1 + tile, tile : tile + head_dim]  # the tile's rows, the KV head's columns
    out = rng.standard_normal(heads * head_dim, dtype=np.float32)
    expected_out = out + np.concatenate([weights[i, 3 : 3 + tile] @ seen for i in range(heads)])
    scores = tiles(q, rows, weights, out)
    expected = np.zeros((heads, tile + 5), np.float32)
    expected[:, 2 : 2 + tile] = 0.5 * q.reshape(heads, head_dim) @ seen.T
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_pos", [1, 2, 15, 16, 31, 32, 100, 128, 129, 256, 257, 2048, 2049])
@pytest.mark.parametrize("threads", [1, 2, 8])
def test_decode_spans_cover_the_cache_in_bounded_pieces(n_pos, threads, monkeypatch):
    """The thread count is read at each call (a cached kernel would keep the one it was compiled under)."""
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", threads)
    span = attention.decode_span(n_pos)
    n_spans = -(-n_pos // span)
    assert 1 <= span <= attention.DECODE_SPAN
    assert (n_spans - 1) * span < n_pos <= n_spans * span  # every position in exactly one span, none empty
    if n_pos >= attention.MIN_SPAN * threads:  # enough positions: at least one span per thread
        assert n_spans >= threads


def test_exp_f32_is_within_two_ulp_of_exact_and_clamps_to_the_float32_range():
    exp_all = njit(lambda xs: np.array([ops.exp_f32(v) for v in xs], dtype=np.float32))
    x = np.concatenate([np.linspace(-87, 88, 200_001, dtype=np.float32), np.float32([0.0, -1e-8, 1e-8])])
    exact = np.exp(x.astype(np.float64))
    ulps = np.abs(exp_all(x) - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 2
    assert exp_all(np.float32([0.0]))[0] == 1.0
    low, high = exp_all(np.float32([-np.inf, np.inf]))
    assert 0 < low < 1e-37 and np.isfinite(high) and high > 1e38


def test_prefetch_ahead_asks_for_later_rows_and_never_faults_past_the_end():
    """A loop streaming through rows asks for each row's bytes PREFETCH_AHEAD further on: past the
    array's end on its last rows, which must not fault; on x86 the loop holds the prefetch instruction."""

    @njit
    def stream(rows):
        total = np.float32(0)
        for i in range(rows.shape[0]):
            llvm_ir.prefetch_ahead(rows, i)
            for j in range(rows.shape[1]):
                total += rows[i, j]
        return total

    rows = np.ones((3, 1000), np.float32)  # 12 KB: every prefetch of row 1 and 2 lands past the end
    assert stream(rows) == 3000
    assert stream(rows[:0]) == 0
    asm = stream.inspect_asm(stream.signatures[0])
    if "xmm" in asm:  # an x86 target
        assert "prefetcht0" in asm
