"""`--kv window`: sinks plus a ring buffer per sliding layer. What it holds after many writes, what it
refuses, that it equals the full cache while the sequence fits, and what it costs on a real text."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from conftest import FIXTURES

from inferno.cli.generate import main as generate_main
from inferno.errors import InfernoError
from inferno.file.reader import open_gguf
from inferno.kernels.attention import attention_decode, attention_window
from inferno.kernels.ops import Rotary
from inferno.kv import KVCacheFullError, KVGeometry, kivi, make_cache, planned_nbytes, recent
from inferno.kv.dtypes import element_type
from inferno.kv.prealloc import PreallocKVCache
from inferno.kv.snapshot import Snapshot
from inferno.kv.window import WindowKVCache
from inferno.model.transformer import Transformer

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 4
WIDTH = KV_HEADS * HEAD_DIM
GEOMETRY = KVGeometry(layers=LAYERS, kv_heads=KV_HEADS, heads=4, head_dim=HEAD_DIM)
ROTARY = [Rotary(np.array([1.0, 0.1], np.float32), neox=False)] * 8  # per layer, for any test geometry
TEXT = FIXTURES / "execution_model.txt"


def window_cache(window=5, sinks=2, positions="shift", capacity=64, geometry=GEOMETRY):
    return WindowKVCache(geometry, capacity, window=window, sinks=sinks, positions=positions, rotary=ROTARY)


def rows_of(positions) -> np.ndarray:
    """A row whose every value names its position: what a slot holds is readable."""
    return np.repeat(np.asarray(positions, np.float32)[:, None], WIDTH, axis=1)


def feed(cache, n: int, chunk: int) -> None:
    end = cache.length + n
    for start in range(cache.length, end, chunk):
        at = np.arange(start, min(start + chunk, end))
        for layer in range(LAYERS):
            cache.write(layer, start, rows_of(at), -rows_of(at))
        cache.commit(len(at))


@pytest.mark.parametrize("positions", ["shift", "original"])
@pytest.mark.parametrize("chunk", [1, 3, 40])
def test_after_many_writes_it_holds_exactly_the_sinks_and_the_last_window(positions, chunk):
    cache = window_cache(window=5, sinks=2, positions=positions)
    feed(cache, 23, chunk)
    assert cache.length == 23 and cache.evicted_tokens == 23 - 7
    for layer in range(LAYERS):
        at, keys, values = cache.held_rows(layer)
        assert at.tolist() == [0, 1, 18, 19, 20, 21, 22]
        np.testing.assert_array_equal(keys, rows_of(at))
        np.testing.assert_array_equal(values, -rows_of(at))
    # the ring: position 18 is in slot 2 + (18 - 2) % 5 = 3, written over 3, 8 and 13 before it
    assert cache.keys[0][:, 0].tolist() == [0, 1, 22, 18, 19, 20, 21]


def test_before_it_wraps_it_is_laid_out_as_prealloc():
    cache = window_cache(window=5, sinks=2)
    feed(cache, 7, chunk=2)
    assert cache.evicted_tokens == 0
    np.testing.assert_array_equal(cache.read(1)[0], rows_of(range(7)))
    np.testing.assert_array_equal(cache.head_rows(1, 1, 2, 7)[1], -rows_of(range(2, 7))[:, HEAD_DIM:])


def test_evicted_positions_are_an_error_not_stale_rows():
    cache = window_cache(window=5, sinks=2)
    feed(cache, 12, chunk=1)
    with pytest.raises(InfernoError, match=r"positions 0\.\.11: it holds sinks 0\.\.1 and positions 7\.\.11"):
        cache.read(0)
    with pytest.raises(IndexError, match=r"positions 2\.\.6 of layer 1 were evicted"):
        cache.head_rows(1, 0, 0, 12)
    keys, _ = cache.head_rows(1, 0, 8, 12)  # held: fine
    np.testing.assert_array_equal(keys, rows_of(range(8, 12))[:, :HEAD_DIM])
    np.testing.assert_array_equal(cache.read(0, 2)[0], rows_of([0, 1]))  # the sinks stay readable


def test_shift_moves_only_the_sink_keys_by_the_slide():
    cache = window_cache(window=5, sinks=2, positions="shift")
    feed(cache, 11, chunk=11)
    cache.attend(0, np.ones(4 * HEAD_DIM, np.float32), 11)  # the query at 10: slid by 10 - 6 = 4
    moved = rows_of([0, 1])
    ROTARY[0].rotate(moved, KV_HEADS, np.array([4, 4]))
    np.testing.assert_allclose(cache.keys[0][:2], moved, atol=1e-6)
    np.testing.assert_array_equal(cache.held_rows(0)[1][:2], rows_of([0, 1]))  # the originals are kept


def test_sliding_layers_never_refuse_global_layers_do():
    mixed = KVGeometry(layers=LAYERS, kv_heads=KV_HEADS, heads=4, head_dim=HEAD_DIM, windows=(4, None))
    cache = WindowKVCache(mixed, capacity=8, sinks=1, positions="original")
    cache.write(0, 0, rows_of(range(50)), rows_of(range(50)))  # far past the capacity: evicts
    assert cache.held_positions(0).tolist() == [0, 46, 47, 48, 49]
    with pytest.raises(InfernoError, match="sized for 8"):
        cache.write(1, 0, rows_of(range(9)), rows_of(range(9)))
    assert cache.nbytes == WindowKVCache.planned_nbytes(mixed, 8, sinks=1, positions="original")
    assert cache.nbytes == 2 * (1 + 4 + 8) * WIDTH * 4


@pytest.mark.parametrize("positions", ["shift", "original"])
def test_memory_is_the_planned_bytes_and_stays_flat(positions):
    cache = window_cache(window=5, sinks=2, positions=positions)
    before = cache.nbytes
    feed(cache, 40, chunk=3)
    sink_copies = 2 * LAYERS if positions == "shift" else 0  # keys of the sinks at their own rotation
    assert cache.nbytes == before == (2 * LAYERS * 7 + sink_copies) * WIDTH * 4
    assert cache.nbytes == WindowKVCache.planned_nbytes(GEOMETRY, 64, window=5, sinks=2, positions=positions)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(window=0), "window must be at least 1"),
        (dict(window=4, sinks=4), "4 sinks must be fewer than the window of 4"),
        (dict(window=62, sinks=4), "window of 62 \\+ 4 sinks is more than the cache's 64"),
        (dict(window=8, positions="middle"), "unknown window positions 'middle'"),
        (dict(sinks=2), "needs a window"),
        (dict(window=8, sinks=-1), "sinks must be at least 0"),
    ],
)
def test_bad_settings_are_refused(options, message):
    with pytest.raises(InfernoError, match=message):
        make_cache("window", GEOMETRY, 64, rotary=ROTARY, **options)


def test_window_options_are_refused_for_other_kinds():
    with pytest.raises(InfernoError, match="window do not apply to a 'prealloc' cache"):
        make_cache("prealloc", GEOMETRY, 64, window=8)


def test_windowed_attention_is_each_querys_softmax_over_what_it_may_see():
    rng = np.random.default_rng(0)
    n_heads, head_dim, kv_heads, window, sinks = 4, 8, 2, 6, 2
    key_pos = rng.permutation(30)  # the order of the rows must not matter
    keys = rng.standard_normal((30, kv_heads * head_dim), dtype=np.float32)
    values = rng.standard_normal((30, kv_heads * head_dim), dtype=np.float32)
    q = rng.standard_normal((12, n_heads * head_dim), dtype=np.float32)
    got = attention_window(q, keys, values, key_pos, 18, n_heads, window, sinks, block=5)
    for t in range(12):
        at = 18 + t
        seen = (key_pos <= at) & ((key_pos < sinks) | (key_pos > at - window))
        assert seen.sum() == sinks + window
        for h in range(n_heads):
            g = h // (n_heads // kv_heads)
            k = keys[seen][:, g * head_dim : (g + 1) * head_dim].astype(np.float64)
            v = values[seen][:, g * head_dim : (g + 1) * head_dim].astype(np.float64)
            s = k @ q[t, h * head_dim : (h + 1) * head_dim] / np.sqrt(head_dim)
            w = np.exp(s - s.max())
            np.testing.assert_allclose(got[t, h * head_dim : (h + 1) * head_dim], w @ v / w.sum(), atol=1e-5)


# -- element types ---------------------------------------------------------------------------

GROUPED = ("q4_kivi", "q4_recent")  # positions rounded together: rings of blocks
ROW_DTYPES = tuple(d for d in WindowKVCache.dtypes if d not in GROUPED)
BLOCKS = KVGeometry(layers=2, kv_heads=2, heads=4, head_dim=32)  # whole blocks of 32: every row type fits
BLOCKS_ROTARY = [Rotary((10000.0 ** -(np.arange(16) / 16)).astype(np.float32), neox=False)] * 8


def random_rows(n: int, seed: int, geometry: KVGeometry = BLOCKS) -> np.ndarray:
    """Key-like rows: channels of very different sizes, so the element type's rounding shows."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n, geometry.kv_width)) * np.exp(rng.standard_normal(geometry.kv_width))
    return rows.astype(np.float32)


def kept_attention(dtype, keys, values, query, end, window, sinks, positions, layer=0):
    """The query at end - 1 over the kept positions computed another way: a prealloc cache of the same
    element type holding only those rows in position order, the sinks moved by the slide for shift."""
    held = sinks + window
    kept = np.arange(end) if end <= held else np.concatenate([np.arange(sinks), np.arange(end - window, end)])
    k = keys[kept].copy()
    if positions == "shift" and end > held:
        BLOCKS_ROTARY[layer].rotate(k[:sinks], BLOCKS.kv_heads, np.full(sinks, end - held))
    ref = PreallocKVCache(BLOCKS, len(kept), dtype)
    ref.write(layer, 0, k, values[kept])
    return ref.store.attend(layer, query, len(kept))


@pytest.mark.parametrize("positions", ["shift", "original"])
@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_decode_attention_of_each_row_dtype_is_prealloc_until_it_evicts_then_the_kept_rows(dtype, positions):
    window, sinks, n = 6, 2, 21
    keys, values = random_rows(n, 1), random_rows(n, 2)
    queries = random_queries(n, 3)
    cache = WindowKVCache(BLOCKS, 64, window=window, sinks=sinks, positions=positions,
                          rotary=BLOCKS_ROTARY, dtype=dtype)
    full = make_cache("prealloc", BLOCKS, 64, dtype)  # no window: it sees every position
    for t in range(n):
        for c in (cache, full):
            for layer in range(BLOCKS.layers):
                c.write(layer, t, keys[t : t + 1], values[t : t + 1])
            c.commit(1)
        got = cache.attend(1, queries[t], t + 1)
        if t + 1 <= sinks + window:  # nothing evicted: the same stored rows in the same order, same bits
            np.testing.assert_array_equal(got, full.attend(1, queries[t], t + 1))
            np.testing.assert_array_equal(cache.read(0)[0], full.read(0)[0])
        else:
            want = kept_attention(dtype, keys, values, queries[t], t + 1, window, sinks, positions, layer=1)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert cache.evicted_tokens == n - sinks - window
    # readers get the kept rows as the element type rounds them, the sinks at their own rotation
    rounding = element_type(dtype)
    at, held_keys, held_values = cache.held_rows(0)
    np.testing.assert_array_equal(held_keys, rounding.decode(rounding.encode(keys[at], BLOCKS), BLOCKS))
    np.testing.assert_array_equal(held_values, rounding.decode(rounding.encode(values[at], BLOCKS), BLOCKS))
    assert cache.nbytes == planned_nbytes("window", BLOCKS, 64, dtype, window=window, sinks=sinks,
                                          positions=positions)


def random_queries(n: int, seed: int) -> np.ndarray:
    return (0.3 * np.random.default_rng(seed).standard_normal((n, BLOCKS.heads * BLOCKS.head_dim))).astype(
        np.float32)


def prefill_and_decode(dtype: str, positions: str) -> tuple[np.ndarray, np.ndarray]:
    """Attention of 14 queries past the ring's first wrap (window 6, 2 sinks, 10 positions already in):
    at once (prefill), and token by token (decode)."""
    keys, values, queries = random_rows(24, 4), random_rows(24, 5), random_queries(24, 6)

    def cache():
        c = WindowKVCache(BLOCKS, 64, window=6, sinks=2, positions=positions, rotary=BLOCKS_ROTARY,
                          dtype=dtype)
        for layer in range(BLOCKS.layers):
            c.attend_new(layer, 0, queries[:10], keys[:10], values[:10])
        c.commit(10)
        return c

    at_once, stepped = cache(), cache()
    prefilled = at_once.attend_new(0, 10, queries[10:], keys[10:], values[10:])
    decoded = []
    for t in range(10, 24):
        stepped.write(0, t, keys[t : t + 1], values[t : t + 1])
        decoded.append(stepped.attend(0, queries[t], t + 1))
    np.testing.assert_array_equal(at_once.held_rows(0)[1], stepped.held_rows(0)[1])
    return prefilled, np.array(decoded)


@pytest.mark.parametrize("positions", ["shift", "original"])
@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_prefill_over_an_evicting_ring_agrees_with_decode_for_each_row_dtype(dtype, positions):
    """original: the same rounded rows both ways. shift: prefill scores the sinks rounded unmoved (its
    queries move back), decode rounds them moved, so they differ by less than either's rounding error
    against float32 rows (measured: 0.35-0.63 of it)."""
    prefilled, decoded = prefill_and_decode(dtype, positions)
    if positions == "original" or dtype == "f32":
        np.testing.assert_allclose(prefilled, decoded, rtol=0, atol=2e-5)
        return
    _, floats = prefill_and_decode("f32", positions)
    assert np.linalg.norm(prefilled - decoded) < 0.8 * np.linalg.norm(decoded - floats)


@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_stored_rows_move_between_window_caches_as_they_are_stored(dtype):
    """What a snapshot holds: the stored rows (the sinks' at their own rotation once the ring slid)."""
    source = WindowKVCache(BLOCKS, 64, window=6, sinks=2, rotary=BLOCKS_ROTARY, dtype=dtype)
    keys, values = random_rows(7, 7), random_rows(7, 8)
    for layer in range(BLOCKS.layers):
        source.write(layer, 0, keys, values)
    source.commit(7)
    target = WindowKVCache(BLOCKS, 64, window=6, sinks=2, rotary=BLOCKS_ROTARY, dtype=dtype)
    for layer in range(BLOCKS.layers):
        target.write_stored(layer, 0, *source.stored_rows(layer))
    target.commit(7)
    np.testing.assert_array_equal(target.read(1)[0], source.read(1)[0])
    assert source.stored_rows(0)[0].dtype == element_type(dtype).storage
    more = random_rows(10, 9)
    for c in (source, target):
        c.write(0, 7, more, more)
        c.attend(0, random_queries(1, 0)[0], 17)  # slid: the sink slots now hold moved keys
    np.testing.assert_array_equal(target.stored_rows(0, 2)[0], source.stored_rows(0, 2)[0])
    np.testing.assert_array_equal(source.read(0, 2)[0], PreallocKVCache(BLOCKS, 2, dtype).store.dtype.decode(
        element_type(dtype).encode(keys[:2], BLOCKS), BLOCKS))


# -- q4_kivi and q4_recent: rings of blocks ------------------------------------------------------

WIDE = KVGeometry(layers=2, kv_heads=2, heads=4, head_dim=64)  # q4_recent rotates heads of 64
WIDE_ROTARY = [Rotary((10000.0 ** -(np.arange(32) / 32)).astype(np.float32), neox=False)] * 8


def grouped_case(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys with a constant part per channel (what q4_recent's means take out), values and queries of n
    positions."""
    keys = random_rows(n, seed, WIDE) + 3 * random_rows(1, seed + 1, WIDE)
    queries = (0.3 * np.random.default_rng(seed + 2).standard_normal((n, WIDE.heads * WIDE.head_dim))
               ).astype(np.float32)
    return keys, random_rows(n, seed + 3, WIDE), queries


def run_chunks(cache, keys, values, queries, chunks: list[int]) -> Iterator[tuple[int, np.ndarray]]:
    """Positions through every layer in chunks: prefill's attention of a chunk (attend_new), decode's of
    one position (write, attend). (position, layer 1's output) of every query, once its chunk is
    committed."""
    for n in chunks:
        at = slice(cache.length, cache.length + n)
        for layer in range(WIDE.layers):
            if n > 1:
                got = cache.attend_new(layer, at.start, queries[at], keys[at], values[at])
            else:
                cache.write(layer, at.start, keys[at], values[at])
                got = cache.attend(layer, queries[at.start], at.stop)[None]
        cache.commit(n)
        yield from zip(range(at.start, at.stop), got, strict=True)


def window_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, at: int, window: int, sinks: int,
                     positions: str, held: bool = False) -> np.ndarray:
    """Float attention of the query at `at` over the positions a window keeps, from rows keys, values of
    every position (or, `held`, of those kept only), the sinks moved by the slide for shift."""
    kept = np.arange(at + 1)
    if at + 1 > sinks + window:
        kept = np.concatenate([np.arange(sinks), np.arange(at + 1 - window, at + 1)])
    k, v = (keys.copy(), values) if held else (keys[kept], values[kept])
    if positions == "shift" and at + 1 > sinks + window:
        WIDE_ROTARY[1].rotate(k[:sinks], WIDE.kv_heads, np.full(sinks, at + 1 - sinks - window))
    return attention_decode(q, k, v, WIDE.heads)


@pytest.mark.parametrize("positions", ["shift", "original"])
@pytest.mark.parametrize("dtype", GROUPED)
def test_grouped_types_are_prealloc_bit_for_bit_until_the_window_slides(dtype, positions):
    """304 positions (key groups closed, segments' means taken, the q8_0 ring wrapped) in prefill chunks
    and decode steps, in a window of 300 and 4 sinks: every attention and every row read is prealloc's."""
    keys, values, queries = grouped_case(304, 1)
    chunks = [37, 1, 1, 100, 3, *[1] * 60, 70, *[1] * 32]
    window = WindowKVCache(WIDE, 400, window=300, sinks=4, positions=positions, rotary=WIDE_ROTARY,
                           dtype=dtype)
    full = make_cache("prealloc", WIDE, 400, dtype)
    ours, theirs = (list(run_chunks(c, keys, values, queries, chunks)) for c in (window, full))
    for (_, a), (_, b) in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)
    assert window.evicted_tokens == 0 and all(window.wraps)  # every layer a ring that has not slid
    for layer in range(WIDE.layers):
        np.testing.assert_array_equal(window.read(layer)[0], full.read(layer)[0])
        np.testing.assert_array_equal(window.read(layer)[1], full.read(layer)[1])


@pytest.mark.parametrize("positions", ["shift", "original"])
@pytest.mark.parametrize("dtype", GROUPED)
def test_grouped_types_attend_over_the_kept_positions_once_the_window_slid(dtype, positions):
    """A window of 100 and 4 sinks over 700 positions, the ring wrapped many times: prefill chunks that
    cross the slide and run past the ring (in pieces), decode steps. Each decode attention is float
    attention over the rows the cache holds (as it rounded them, the sinks moved by the slide for shift),
    to float32's rounding; every attention is the float reference over the kept positions' exact rows
    to within the type's rounding: no further from it than prealloc of the type is from float attention
    over every position."""
    window, sinks = 100, 4
    keys, values, queries = grouped_case(700, 2)
    cache = WindowKVCache(WIDE, 400, window=window, sinks=sinks, positions=positions, rotary=WIDE_ROTARY,
                          dtype=dtype)
    before = cache.nbytes
    errors = []
    for at, got in run_chunks(cache, keys, values, queries, [150, *[1] * 50, 200, *[1] * 300]):
        want = window_reference(queries[at], keys, values, at, window, sinks, positions)
        errors.append(np.linalg.norm(got - want) / np.linalg.norm(want))
        if at + 1 == cache.length:  # the last query of a step: the rows held now are the ones it read
            held, held_keys, held_values = cache.held_rows(1)
            assert held.tolist() == [*range(sinks), *range(at + 1 - window, at + 1)]
            stored = window_reference(queries[at], held_keys, held_values, at, window, sinks, positions, True)
            np.testing.assert_allclose(got, stored, rtol=1e-4, atol=2e-5)
    full = make_cache("prealloc", WIDE, 700, dtype)
    full_errors = [np.linalg.norm(got - want) / np.linalg.norm(want)
                   for at, got in run_chunks(full, keys, values, queries, [150, *[1] * 50, 200, *[1] * 300])
                   for want in [attention_decode(queries[at], keys[: at + 1], values[: at + 1], WIDE.heads)]]
    # measured (max, mean): q4_kivi 0.17-0.18, 0.07-0.09 against prealloc's 0.20, 0.11; q4_recent 0.41,
    # 0.11-0.14 against 0.41, 0.22 (the largest at the first positions, before anything slid)
    assert max(errors) <= 1.05 * max(full_errors) and np.mean(errors) < np.mean(full_errors)
    assert cache.evicted_tokens == 700 - window - sinks
    assert cache.nbytes == before == planned_nbytes("window", WIDE, 400, dtype, window=window, sinks=sinks,
                                                    positions=positions)
    with pytest.raises(InfernoError, match="no longer holds positions"):
        cache.read(0)
    sink_keys = cache.read(0, sinks)[0]  # still held: the sinks' own copies (f16, q8_0)
    np.testing.assert_allclose(sink_keys, keys[:sinks], rtol=0, atol=0.02 * np.abs(keys[:sinks]).max())


@pytest.mark.parametrize("dtype", GROUPED)
def test_a_grouped_window_keeps_its_global_layers_as_prealloc_does(dtype):
    """A sliding layer (a ring that slides) beside a global one, which is prealloc's store of the
    capacity: bit for bit prealloc's attention, refusing past the capacity."""
    mixed = replace(WIDE, windows=(100, None))
    keys, values, queries = grouped_case(300, 5)
    cache = WindowKVCache(mixed, 300, sinks=4, rotary=WIDE_ROTARY, dtype=dtype)
    full = make_cache("prealloc", WIDE, 300, dtype)
    chunks = [150, *[1] * 50, 100]
    ours, theirs = (list(run_chunks(c, keys, values, queries, chunks)) for c in (cache, full))
    for (_, a), (_, b) in zip(ours, theirs, strict=True):  # layer 1: the global one
        np.testing.assert_array_equal(a, b)
    assert cache.wraps == [True, False] and cache.evicted(0) == 300 - 104 and cache.evicted(1) == 0
    np.testing.assert_array_equal(cache.read(1)[0], full.read(1)[0])
    with pytest.raises(KVCacheFullError, match="sized for 300"):
        cache.write(1, 300, keys[:1], values[:1])


@pytest.mark.parametrize("dtype", GROUPED)
def test_prefill_over_a_slid_ring_agrees_with_decode_for_grouped_types(dtype):
    """The same 400 positions as one prefill chunk (in pieces of a block) or token by token, after a
    prompt of 90: the same rows held. Prefill reads rows as they are at its piece's end (older ones
    rounded to 4 bits that decode still reads in f16 or q8_0), as prealloc's prefill does at its chunk's:
    it is no further from the float reference than prealloc's prefill, nor from decode than prealloc's
    prefill is from its decode."""
    keys, values, queries = grouped_case(490, 3)

    def outputs(layout: str, chunks: list[int]) -> np.ndarray:
        cache = (WindowKVCache(WIDE, 400, window=100, sinks=4, rotary=WIDE_ROTARY, dtype=dtype)
                 if layout == "window" else make_cache("prealloc", WIDE, 490, dtype))
        out = np.array([got for _, got in run_chunks(cache, keys, values, queries, chunks)])[90:]
        caches.append(cache)
        return out

    def distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)

    caches: list = []
    exact = {"window": np.array([window_reference(queries[at], keys, values, at, 100, 4, "shift")
                                 for at in range(90, 490)]),
             "prealloc": np.array([attention_decode(queries[at], keys[: at + 1], values[: at + 1], WIDE.heads)
                                   for at in range(90, 490)])}
    gaps, errors = {}, {}
    for layout in exact:
        prefilled, decoded = outputs(layout, [90, 400]), outputs(layout, [90, *[1] * 400])
        gaps[layout], errors[layout] = distance(prefilled, decoded), distance(prefilled, exact[layout])
    for layer in range(WIDE.layers):
        for a, b in zip(caches[0].held_rows(layer), caches[1].held_rows(layer), strict=True):
            np.testing.assert_array_equal(a, b)
    # measured (max, mean) against prealloc's: errors q4_kivi 0.21, 0.084 (0.21, 0.12), q4_recent 0.37,
    # 0.12 (0.43, 0.21); gaps' mean q4_kivi 0.041 (0.035), q4_recent 0.047 (0.042)
    assert errors["window"].max() <= 1.05 * errors["prealloc"].max()
    assert errors["window"].mean() < errors["prealloc"].mean()
    assert gaps["window"].mean() < 1.5 * gaps["prealloc"].mean()


@pytest.mark.parametrize("dtype", GROUPED)
def test_grouped_types_held_positions_and_snapshots_before_the_slide(dtype):
    """What a window of q4_kivi or q4_recent hands out: float32 rows (snapshots hold them so), which a
    window cache of the same type takes back while it holds every position."""
    keys, values, _ = grouped_case(150, 4)
    source = WindowKVCache(WIDE, 400, window=200, sinks=4, rotary=WIDE_ROTARY, dtype=dtype)
    for layer in range(WIDE.layers):
        source.write(layer, 0, keys, values)
    source.commit(150)
    stored = source.stored_rows(1)
    assert stored[0].dtype == np.float32 and stored[0].shape == (150, WIDE.kv_width)
    np.testing.assert_array_equal(stored[0], source.read(1)[0])
    np.testing.assert_array_equal(source.head_rows(1, 1, 10, 140)[1], stored[1][10:140, 64:])
    target = WindowKVCache(WIDE, 400, window=200, sinks=4, rotary=WIDE_ROTARY, dtype=dtype)
    for layer in range(WIDE.layers):
        target.write_stored(layer, 0, *source.stored_rows(layer))
    target.commit(150)
    rounding = np.abs(stored[0] - keys).max()  # rounded again on loading: about as far as once more
    np.testing.assert_allclose(target.read(1)[0], stored[0], rtol=0, atol=1.5 * rounding)


SMOLLM2_LIKE = KVGeometry(layers=30, kv_heads=3, heads=9, head_dim=64)
GEMMA_LIKE = KVGeometry(layers=18, kv_heads=1, heads=4, head_dim=256,
                        windows=tuple(None if layer % 6 == 5 else 512 for layer in range(18)))
PLANNED_CASES = [(SMOLLM2_LIKE, 8192, 256), (SMOLLM2_LIKE, 100, 64), (GEMMA_LIKE, 8, None),
                 (GEMMA_LIKE, 600, None), (GEMMA_LIKE, 516, None), (GEMMA_LIKE, 32768, None)]


@pytest.mark.parametrize("positions", ["shift", "original"])
@pytest.mark.parametrize(("geometry", "capacity", "window"), PLANNED_CASES)
@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_planned_bytes_are_what_the_cache_allocates_for_every_row_dtype(dtype, geometry, capacity, window,
                                                                         positions):
    options = dict(window=window, positions=positions)
    cache = make_cache("window", geometry, capacity, dtype, rotary=[ROTARY[0]] * 30, **options)
    assert cache.nbytes == planned_nbytes("window", geometry, capacity, dtype, **options)
    rows = cache.rows
    kv_bytes = 2 * sum(rows) * element_type(dtype).row_bytes(geometry)
    shifting = sum(cache.wraps) if positions == "shift" else 0
    assert cache.nbytes == kv_bytes + shifting * 4 * geometry.kv_width * 4  # + the sinks' float32 copies


@pytest.mark.parametrize("positions", ["shift", "original"])
@pytest.mark.parametrize(("geometry", "capacity", "window"), PLANNED_CASES)
@pytest.mark.parametrize("dtype", GROUPED)
def test_planned_bytes_are_what_the_cache_allocates_for_grouped_types(dtype, geometry, capacity, window,
                                                                      positions):
    """A sliding layer that slides holds its ring, its state and its sinks (no float32 copies: shift moves
    the query); a layer keeping every position, prealloc's store of its rows."""
    options = dict(window=window, positions=positions)
    cache = make_cache("window", geometry, capacity, dtype, rotary=[ROTARY[0]] * 30, **options)
    assert cache.nbytes == planned_nbytes("window", geometry, capacity, dtype, **options)
    one = replace(geometry, layers=1, windows=())
    ring_nbytes = kivi.ring_nbytes if dtype == "q4_kivi" else recent.ring_nbytes
    for layer, store in enumerate(cache.stores):
        if cache.wraps[layer]:
            assert store.nbytes == ring_nbytes(one, cache.geometry.window(layer), 4)
        else:
            assert store.nbytes == planned_nbytes("prealloc", one, cache.rows[layer], dtype)


def test_a_grouped_window_allocates_its_ring_not_its_capacity():
    """SmolLM2's shape, a window of 256 and 4 sinks in 8,192 tokens. q4_kivi: 5 blocks of 64 positions
    (the sinks and window fit in them, and a group more than the window, for prefill's pieces), the open
    group and the sinks in f16. q4_recent: 3 blocks of 128 and 3 key means, the q8_0 ring of 22 and the
    sinks in q8_0. Writing 1,000 positions changes nothing."""
    g, w = SMOLLM2_LIKE, SMOLLM2_LIKE.kv_width
    assert kivi.key_row_bytes(g) == kivi.value_row_bytes(g) == 108  # 4.5 bits a value
    assert recent.body_row_bytes(w) == 102 and recent.ring_row_bytes(w) == 204  # 4.25, 8.5 bits
    per_layer = {"q4_kivi": 5 * 64 * 2 * 108 + 2 * 64 * w * 2 + 2 * 4 * w * 2,
                 "q4_recent": 3 * 128 * 2 * 102 + 2 * (22 + 4) * 204 + 3 * w * 2}
    rows = random_rows(1000, 0, g)
    for dtype, nbytes in per_layer.items():
        cache = make_cache("window", g, 8192, dtype, window=256, rotary=[ROTARY[0]] * 30)
        assert cache.nbytes == planned_nbytes("window", g, 8192, dtype, window=256) == 30 * nbytes
        assert cache.nbytes < planned_nbytes("prealloc", g, 8192, dtype) / 10
        for layer in range(g.layers):
            cache.write(layer, 0, rows, rows)
        cache.commit(1000)
        assert cache.nbytes == 30 * nbytes and cache.evicted_tokens == 1000 - 260


def test_a_gemma_like_cache_for_a_short_request_allocates_only_what_it_keeps():
    """An 8-token request: 8 rows a layer, sliding or global, as prealloc; not the 516 and 32,768 slots
    of the model's context (207 MiB in f32)."""
    for dtype in ("f32", "q8_0"):
        cache = make_cache("window", GEMMA_LIKE, 8, dtype, rotary=[ROTARY[0]] * 18)
        assert cache.rows == [8] * 18 and not any(cache.wraps) and cache.capacity == 8
        assert cache.nbytes == planned_nbytes("prealloc", GEMMA_LIKE, 8, dtype)
    assert planned_nbytes("window", GEMMA_LIKE, 8) == 2 * 18 * 8 * 256 * 4  # 288 KiB
    assert planned_nbytes("window", GEMMA_LIKE, 32768) == (
        2 * (15 * 516 + 3 * 32768) + 15 * 4) * 256 * 4  # 207.2 MiB
    rows = random_rows(9, 0, GEMMA_LIKE)
    cache.write(0, 0, rows[:8], rows[:8])  # a sliding layer of 8 slots never wraps: it refuses as prealloc
    with pytest.raises(KVCacheFullError, match="sized for 8"):
        cache.write(0, 8, rows[8:], rows[8:])
    np.testing.assert_allclose(cache.read(0, 8)[0], rows[:8], rtol=0.01, atol=0.02 * np.abs(rows).max())
    roomy = make_cache("window", GEMMA_LIKE, 600, rotary=[ROTARY[0]] * 18)  # past the window: the rings
    assert roomy.rows == [600 if w is None else 516 for w in GEMMA_LIKE.windows]
    long = random_rows(700, 1, GEMMA_LIKE)
    roomy.write(0, 0, long, long)  # slides, never refuses
    assert roomy.evicted(0) == 700 - 516


# -- on models ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return Transformer.from_gguf(open_gguf(FIXTURES / "tiny_llama.gguf"))


def test_tiny_model_logits_are_prealloc_bits_while_the_sequence_fits(tiny):
    ids = np.random.default_rng(2).integers(0, tiny.config.vocab_size, 60)
    full = make_cache("prealloc", tiny.config.kv_geometry, len(ids))
    window = make_cache("window", tiny.config.kv_geometry, 256, window=56,  # + 4 sinks
                        rotary=tiny.layer_rotary)
    logits = {}
    for name, cache in (("full", full), ("window", window)):
        logits[name] = [tiny.prefill(ids[:3], cache)]
        logits[name] += [tiny.decode(int(t), p, cache) for p, t in enumerate(ids[3:], start=3)]
    np.testing.assert_array_equal(np.array(logits["window"]), np.array(logits["full"]))


@pytest.mark.parametrize("positions", ["shift", "original"])
def test_tiny_model_runs_past_its_context_and_prefill_agrees_with_decode(tiny, positions):
    """300 positions through a model trained for 256: the prompt at once, or token by token."""
    context = tiny.config.context_length
    ids = np.random.default_rng(1).integers(0, tiny.config.vocab_size, context + 44)

    def cache():
        return make_cache("window", tiny.config.kv_geometry, context, window=32, positions=positions,
                          rotary=tiny.layer_rotary)

    at_once = cache()
    prefilled = tiny.prefill(ids, at_once, every_logit=True)
    stepped = cache()
    decoded = [tiny.prefill(ids[:1], stepped)]
    decoded += [tiny.decode(int(t), p, stepped) for p, t in enumerate(ids[1:], start=1)]
    np.testing.assert_allclose(prefilled, np.array(decoded), rtol=0, atol=1e-4)
    assert np.isfinite(prefilled).all()
    assert at_once.evicted_tokens == stepped.evicted_tokens == len(ids) - 36
    assert at_once.nbytes == stepped.nbytes == cache().nbytes


def test_smollm2_tokens_equal_prealloc_while_they_fit_and_memory_stays_flat_after(engine):
    full = engine.generate("Once upon a time", 40, kv="prealloc", ignore_eos=True)
    fits = engine.generate("Once upon a time", 40, kv="window", window=60, ignore_eos=True)
    assert fits.token_ids == full.token_ids and fits.metrics.evicted_tokens == 0
    slides = engine.generate("Once upon a time", 40, kv="window", window=16, ignore_eos=True)
    assert slides.metrics.evicted_tokens == 4 + 39 - 20
    assert slides.metrics.cache_bytes == 2 * 30 * 20 * 192 * 4 + 30 * 4 * 192 * 4  # + the sinks' own keys
    assert slides.token_ids[:12] == full.token_ids[:12]  # identical until the window slides


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0h"])
def test_smollm2_greedy_tokens_of_a_window_that_evicts_nothing_are_prealloc_of_the_same_dtype(engine, dtype):
    ids = engine.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    new, geometry, rotary = 16, engine.config.kv_geometry, engine.model.layer_rotary
    capacity = len(ids) + new
    caches = {"prealloc": make_cache("prealloc", geometry, capacity, dtype),
              "window": make_cache("window", geometry, engine.config.context_length, dtype,
                                   window=capacity, rotary=rotary)}  # + 4 sinks: nothing is evicted
    tokens, logits = {}, {}
    for name, cache in caches.items():
        step = engine.model.prefill(np.array(ids), cache)
        tokens[name], logits[name] = [], [step]
        for pos in range(len(ids), capacity - 1):
            tokens[name].append(int(np.argmax(step)))
            step = engine.model.decode(tokens[name][-1], pos, cache)
            logits[name].append(step)
    assert tokens["window"] == tokens["prealloc"] and len(tokens["window"]) == new - 1
    np.testing.assert_array_equal(np.array(logits["window"]), np.array(logits["prealloc"]))
    assert caches["window"].evicted_tokens == 0
    assert caches["window"].nbytes == planned_nbytes("window", geometry, engine.config.context_length, dtype,
                                                     window=capacity, rotary=rotary)


def test_only_a_window_cache_may_run_past_the_models_context(engine):
    context = engine.config.context_length
    cache = engine.make_cache("window", 10, context, window=64)
    assert cache.evicts and cache.capacity == 64 + 4  # what it holds at most
    with pytest.raises(InfernoError, match="more than the model's context"):
        engine.make_cache("prealloc", 10, context)
    with pytest.raises(InfernoError, match="longer than the model's context"):
        engine.make_cache("prealloc", context + 1, 1)
    assert engine.make_cache("window", context + 1, 1, window=64).length == 0


def test_perplexity_of_a_long_text_stays_close_to_the_full_caches(engine):
    """The first 1,024 tokens of the text (8 windows) with a 128-token window and 4 sinks."""
    from inferno.analysis.perplexity import perplexity, token_nll

    ids = engine.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:1024]
    full = perplexity(token_nll(engine.model, ids, engine.make_cache("prealloc", len(ids), 0)))
    window = engine.make_cache("window", len(ids), 0, window=128)
    windowed = perplexity(token_nll(engine.model, ids, window))
    assert window.evicted_tokens == 1023 - 132
    assert 1.0 < windowed / full < 1.20  # measured: 12.99 -> 14.72, 1.13x


@pytest.mark.parametrize("dtype", GROUPED)
def test_smollm2_perplexity_of_a_grouped_window_is_its_float_windows_within_the_types_loss(engine, dtype):
    """The first 512 tokens of the text through a 128-token window and 4 sinks (prefill in pieces over a
    ring that slid): what q4_kivi or q4_recent adds to the f32 window's perplexity is about what it adds
    to prealloc's, in memory that is the planned bytes."""
    from inferno.analysis.perplexity import perplexity, token_nll

    ids = engine.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:512]
    scores, caches = {}, {}
    for layout, kv_dtype, options in [("prealloc", "f32", {}), ("prealloc", dtype, {}),
                                    ("window", "f32", {"window": 128}), ("window", dtype, {"window": 128})]:
        cache = caches[layout, kv_dtype] = engine.make_cache(layout, len(ids), 0, dtype=kv_dtype, **options)
        scores[layout, kv_dtype] = perplexity(token_nll(engine.model, ids, cache))
    cache = caches["window", dtype]
    assert cache.evicted_tokens == 511 - 132
    assert cache.nbytes == planned_nbytes("window", engine.config.kv_geometry, engine.config.context_length,
                                          dtype, window=128)
    full_loss = scores["prealloc", dtype] / scores["prealloc", "f32"]
    window_loss = scores["window", dtype] / scores["window", "f32"]
    # measured: q4_kivi 20.34 / 19.99 = 1.018 (prealloc 18.85 / 18.44 = 1.022); q4_recent 20.63 / 19.99 =
    # 1.032 (18.92 / 18.44 = 1.026)
    assert window_loss - 1 < 1.5 * (full_loss - 1)


def test_a_window_snapshot_is_saved_until_it_evicts_then_refused(engine, tmp_path):
    prompt = engine.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    cache = engine.make_cache("window", len(prompt), 1, window=len(prompt) + 4)
    engine.model.prefill(np.array(prompt), cache)
    path = tmp_path / "window.safetensors"
    Snapshot.from_cache(cache, prompt, engine.config, engine.fingerprint).save(path)
    restored = engine.make_cache("window", len(prompt), 1, window=8)  # loads into a smaller window too
    assert Snapshot.load(path).restore(restored, [*prompt, 42]) == len(prompt)
    assert restored.evicted_tokens == len(prompt) - 12
    with pytest.raises(InfernoError, match="no longer holds positions"):
        Snapshot.from_cache(restored, prompt, engine.config, engine.fingerprint)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kv", "prealloc", "--window", "8"], "apply to --kv window"),
        (["--kv", "window"], "needs a window"),
        (["--kv", "window", "--window", "8", "--sinks", "8"], "8 sinks must be fewer than the window of 8"),
        (["--kv", "window", "--window", "64", "--max-context", "32"], r"32 tokens \(--max-context 32\)"),
    ],
)
def test_cli_refuses_bad_window_settings_in_one_line(run_main, model_path, args, message):
    code, out, err = run_main(generate_main, "model-generate", *args, model_path, "Hello", "4")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and re.search(message, err)
