"""The paged pool in every row element type, with sliding-window layer groups (Gemma 3's shape), and
the block accounting a scheduler reserves with (blocks_needed, prepare)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from inferno.errors import InfernoError
from inferno.kv import KVCacheFullError, KVGeometry, kivi, make_cache, planned_nbytes, recent
from inferno.kv.batch import PagedBatch
from inferno.kv.paged import PagedKVCache
from inferno.kv.pool import HOLE, PAGED_DTYPES, BlockPool, layer_groups

# 6 layers: 2 global, 4 sliding over 6 positions -> 3 groups of 2 layers (global, sliding, sliding)
HYBRID = KVGeometry(layers=6, kv_heads=2, heads=4, head_dim=64, windows=(None, 6, 6, None, 6, 6))
FLAT = KVGeometry(layers=2, kv_heads=2, heads=4, head_dim=64)
RNG = np.random.default_rng(3)
CHANNEL_BIAS = 3 * RNG.standard_normal(1024, dtype=np.float32)
GROUPED = ("q4_recent", "q4_kivi")  # types whose state spans positions: a sequence keeps it beside its blocks


def first_held(dtype: str, length: int, window: int) -> int:
    """The first position a sliding group holds after `length`: the first a later query sees; for
    q4_kivi the first of its key group, for q4_recent at most the first of the segment whose mean is
    taken next (from its rows)."""
    first = max(length + 1 - window, 0)
    if dtype == "q4_kivi":
        return first // kivi.GROUP * kivi.GROUP
    if dtype == "q4_recent":
        return min(first, max(length - 1, 0) // recent.SEGMENT * recent.SEGMENT)
    return first


def rows(g: KVGeometry, n: int) -> tuple[np.ndarray, np.ndarray]:
    return (RNG.standard_normal((n, g.kv_width), dtype=np.float32),
            RNG.standard_normal((n, g.kv_width), dtype=np.float32))


def step(caches, n: int, queries: np.ndarray | None = None) -> list[list[np.ndarray]]:
    """n tokens into every cache (the same rows), then each layer's attention of a query at the last
    position in each cache (decode) or of the chunk's queries (prefill, attend_new). Keys get a part
    that differs per channel (as a model's do): the key means of q4_recent have something to take out."""
    g = caches[0].geometry
    out: list[list[np.ndarray]] = [[] for _ in caches]
    for layer in range(g.layers):
        k, v = rows(g, n)
        k += CHANNEL_BIAS[: g.kv_width]
        q = RNG.standard_normal((n, g.heads * g.head_dim), dtype=np.float32)
        for i, cache in enumerate(caches):
            pos = cache.length
            if n > 1:
                out[i].append(cache.attend_new(layer, pos, q, k, v))
            else:
                cache.write(layer, pos, k, v)
                out[i].append(cache.attend(layer, q[0], pos + 1))
    for cache in caches:
        cache.commit(n)
    return out


def test_layer_groups_are_equal_sized_and_global_first():
    groups = layer_groups(HYBRID)
    assert [(g.layers, g.window) for g in groups] == [((0, 3), None), ((1, 2), 6), ((4, 5), 6)]
    assert [g.layers for g in layer_groups(FLAT)] == [(0, 1)]


@pytest.mark.parametrize("dtype", PAGED_DTYPES)
def test_sliding_groups_attend_like_prealloc_and_release_their_blocks(dtype):
    """Chunks and single tokens, each attention equal to prealloc's of the same geometry and element
    type; a sliding group holds at most window / block_size + 2 blocks."""
    bs = 2
    paged = PagedKVCache(HYBRID, 40, block_size=bs, dtype=dtype)
    dense = make_cache("prealloc", HYBRID, 40, dtype)
    for n in (5, 1, 1, 4, 1, 1, 1, 3, 1, 1, 1, 1, 7, 1, 1):
        ours, theirs = step([paged, dense], n)
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
        for g, group in enumerate(paged.groups):
            held = [b for b in paged.tables[g] if b != HOLE]
            if group.window is None:
                assert len(held) == -(-paged.length // bs)
            else:
                first = first_held(dtype, paged.length, group.window) // bs
                assert len(held) == -(-paged.length // bs) - first
                assert len(held) <= group.window // bs + 2 or dtype in GROUPED
                assert (paged.tables[g][0] == HOLE) == (first >= 1)
    assert paged.pool.used_blocks == len(paged.held_blocks())
    if dtype in GROUPED:  # 40 positions: its first key group, its first segment, none released yet
        assert HOLE not in paged.tables[1]
    else:
        with pytest.raises(InfernoError, match="released"):
            paged.read(1)
    np.testing.assert_array_equal(paged.read(0)[0], dense.read(0)[0])  # global layers keep every row
    paged.reset()
    assert paged.pool.used_blocks == 0


def test_batched_decode_of_forks_attends_like_each_alone():
    """PagedBatch over forks of one prompt (hybrid groups, q8_0): equal to each fork decoding alone."""
    pool = BlockPool(HYBRID, 60, block_size=2, dtype="q8_0")
    parent = PagedKVCache(HYBRID, 30, pool=pool)
    assert parent.dtype.name == "q8_0"
    step([parent], 9)
    forks = [parent.fork() for _ in range(2)]
    caches = [parent, *forks]
    for _ in range(5):
        batch = PagedBatch(caches)
        qs, outs = [], []
        for layer in range(HYBRID.layers):
            k, v = rows(HYBRID, 3)
            q = RNG.standard_normal((3, HYBRID.heads * HYBRID.head_dim), dtype=np.float32)
            batch.write(layer, k, v)
            outs.append(batch.attend(layer, q, HYBRID.heads))
            qs.append(q)
        for b, cache in enumerate(caches):  # each alone, through its own tables
            for layer in range(HYBRID.layers):
                alone = cache.attend(layer, qs[layer][b], cache.length + 1)
                np.testing.assert_allclose(outs[layer][b], alone, rtol=1e-5, atol=1e-6)
        batch.commit()
    for g in range(len(pool.groups)):  # the prompt's first full block the forks still share
        if pool.groups[g].window is None:
            assert parent.tables[g][0] == forks[0].tables[g][0] and pool.refs[parent.tables[g][0]] == 3


@pytest.mark.parametrize("dtype", PAGED_DTYPES)
def test_planned_bytes_are_the_pools_storage(dtype):
    for g in (FLAT, HYBRID):
        cache = make_cache("paged", g, 50, dtype, block_size=16)
        pool = cache.pool.keys.nbytes + cache.pool.values.nbytes
        own = 0 if cache.state is None else cache.state.nbytes  # q4_recent's ring..., q4_kivi's open group
        assert planned_nbytes("paged", g, 50, dtype, block_size=16) == pool + own
        assert pool == cache.pool.nbytes
        step([cache], 50)
        if not g.sliding:  # every block of the pool held: the rows at the element type's bytes
            assert cache.nbytes == pool + own
            if dtype not in GROUPED:
                assert pool == 2 * g.layers * 64 * cache.dtype.row_bytes(g)
    w = FLAT.kv_width  # a block of 16 positions: q4_recent's 4.25-bit rows, q4_kivi's 4.5-bit keys and values
    if dtype == "q4_recent":
        assert BlockPool.planned_block_nbytes(FLAT, 16, dtype) == 2 * FLAT.layers * 16 * w * 4.25 / 8
    if dtype == "q4_kivi":
        assert BlockPool.planned_block_nbytes(FLAT, 16, dtype) == 2 * FLAT.layers * 16 * w * 4.5 / 8


def test_q4_kivi_block_sizes_line_up_with_its_key_groups():
    for bs in (1, 16, 64, 128):
        make_cache("paged", FLAT, 8, "q4_kivi", block_size=bs)
    with pytest.raises(InfernoError, match=r"divides 64 or is a multiple of it.*not 48") as e:
        make_cache("paged", FLAT, 8, "q4_kivi", block_size=48)
    assert "\n" not in str(e.value)


def replay(caches, chunks: list[int], seed: int) -> list[list[np.ndarray]]:
    """step over chunks with rows drawn from their own generator: the same seed, the same rows."""
    global RNG
    saved, RNG = RNG, np.random.default_rng(seed)
    try:
        return [out for n in chunks for out in zip(*step(caches, n), strict=True)]
    finally:
        RNG = saved


WIDE = replace(HYBRID, windows=tuple(None if w is None else 150 for w in HYBRID.windows))


@pytest.mark.parametrize("dtype", GROUPED)
@pytest.mark.parametrize(("geometry", "block_size"), [(FLAT, 16), (FLAT, 128), (HYBRID, 2), (HYBRID, 16),
                                                      (WIDE, 16)],
                         ids=["flat-16", "flat-128", "window6-2", "window6-16", "window150-16"])
def test_grouped_types_in_blocks_are_prealloc_bit_for_bit(dtype, geometry, block_size):
    """q4_recent and q4_kivi past their ring, segments and groups (300 positions, prefill chunks and
    decode steps), global and sliding groups: every attention equal to prealloc's, bit for bit."""
    paged = PagedKVCache(geometry, 320, block_size=block_size, dtype=dtype)
    dense = make_cache("prealloc", geometry, 320, dtype)
    for ours, theirs in replay([paged, dense], [37, 1, 1, 100, 3, *[1] * 60, 70, *[1] * 28], 5):
        np.testing.assert_array_equal(ours, theirs)
    for layer, window in enumerate(geometry.windows or (None,) * geometry.layers):
        if window is None:  # global layers: every row
            np.testing.assert_array_equal(paged.read(layer)[0], dense.read(layer)[0])
    paged.reset()
    assert paged.pool.used_blocks == 0


@pytest.mark.parametrize("dtype", GROUPED)
def test_forks_of_grouped_types_keep_their_own_state(dtype):
    """Forks of a 100-position prompt, each then written its own rows: each equal to a prealloc cache
    given the prompt and its rows (q4_kivi: the open group's blocks are each fork's own)."""
    pool = BlockPool(HYBRID, 400, block_size=16, dtype=dtype)
    parent = PagedKVCache(HYBRID, 300, pool=pool)
    replay([parent], [100], 1)
    forks = [parent, parent.fork(), parent.fork()]
    assert pool.refs[parent.tables[0][0]] == 3  # the prompt's first block (a closed key group), shared
    for i, fork in enumerate(forks):
        alone = make_cache("prealloc", HYBRID, 300, dtype)
        replay([alone], [100], 1)
        for ours, theirs in replay([fork, alone], [1] * 40 + [30, 1], 10 + i):
            np.testing.assert_array_equal(ours, theirs)
    for fork in forks:
        fork.reset()
    assert pool.used_blocks == 0
    if dtype == "q4_kivi":
        with pytest.raises(InfernoError, match="forks at its own capacity"):
            PagedKVCache(FLAT, 10, dtype=dtype).fork(20)


def feed(cache, n: int, seed: int = 7) -> list[np.ndarray]:
    """Positions cache.length .. + n - 1 of every layer from one fixed table (rows and queries are a
    function of the position): caches fed the same positions in any chunks hold the same rows."""
    g, pos = cache.geometry, cache.length
    table = np.random.default_rng(seed)
    k = table.standard_normal((g.layers, 400, g.kv_width), dtype=np.float32) + CHANNEL_BIAS[: g.kv_width]
    v = table.standard_normal((g.layers, 400, g.kv_width), dtype=np.float32)
    q = table.standard_normal((g.layers, 400, g.heads * g.head_dim), dtype=np.float32)
    out = []
    for layer in range(g.layers):
        at = slice(pos, pos + n)
        if n > 1:
            out.append(cache.attend_new(layer, pos, q[layer, at], k[layer, at], v[layer, at]))
        else:
            cache.write(layer, pos, k[layer, at], v[layer, at])
            out.append(cache.attend(layer, q[layer, pos], pos + 1))
    cache.commit(n)
    return out


def test_q4_kivi_shares_whole_key_groups_and_q4_recent_shares_no_prefix():
    tokens = list(range(1000, 1200))
    pool = BlockPool(FLAT, 60, block_size=16, dtype="q4_kivi")
    first = PagedKVCache(FLAT, 300, pool=pool)
    for n in (100, 1, 1):
        feed(first, n)
    first.publish(tokens)
    assert first.published == 4  # the blocks of the closed group 0: group 1's hold nothing yet
    again = PagedKVCache(FLAT, 300, pool=pool)
    assert again.reuse_prefix(tokens[:150]) == 64 and again.tables[0] == first.tables[0][:4]
    alone = make_cache("prealloc", FLAT, 300, "q4_kivi")
    feed(alone, 102)
    feed(again, 38)
    for _ in range(40):  # past the close of group 1 (position 127), which each rounds into its own blocks
        ours, theirs, dense = feed(again, 1), feed(first, 1), feed(alone, 1)
        for a, b, c in zip(ours, theirs, dense, strict=True):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)
    first.publish(tokens)
    assert first.published == 8 and pool.refs[first.tables[0][3]] == 2
    assert first.tables[0][4] != again.tables[0][4]
    recent_pool = BlockPool(FLAT, 60, block_size=16, dtype="q4_recent")
    one = PagedKVCache(FLAT, 300, pool=recent_pool)
    feed(one, 100)
    one.publish(tokens)
    other = PagedKVCache(FLAT, 300, pool=recent_pool)
    assert one.published == 0 and other.reuse_prefix(tokens[:150]) == 0 and not any(other.tables)


def test_blocks_needed_is_what_prepare_takes_and_a_refusal_changes_nothing():
    pool = BlockPool(HYBRID, 14, block_size=4)
    a = PagedKVCache(HYBRID, 40, pool=pool)
    assert a.blocks_needed(6) == 3 * 2  # two blocks in each of three groups
    free = pool.free_blocks
    a.prepare(0, 6)
    assert free - pool.free_blocks == 6 and a.blocks_needed(6) == 0
    step([a], 6)  # written into what prepare took: nothing more
    assert pool.free_blocks == free - 6
    b = a.fork()  # shares the partial block 1 of every group: a write copies it
    assert b.blocks_needed(7) == 3
    free = pool.free_blocks
    b.prepare(6, 7)
    assert free - pool.free_blocks == 3
    step([b], 1)
    assert b.blocks_needed(12) == 3  # a third block in each group
    tables, refs, n_free = [list(t) for t in a.tables], pool.refs.copy(), pool.free_blocks
    with pytest.raises(KVCacheFullError, match="need"):
        a.prepare(6, 6 + 4 * 8)
    assert a.tables == tables and (pool.refs == refs).all() and pool.free_blocks == n_free
    assert a.blocks_needed(6 + 4 * 8) > pool.free_blocks
    a.reset()
    b.reset()
    assert pool.used_blocks == 0 and pool.free_blocks == 14


def test_prefix_reuse_needs_every_group_to_hold_what_a_query_sees():
    pool = BlockPool(HYBRID, 40, block_size=2)
    tokens = list(range(50, 70))
    first = PagedKVCache(HYBRID, 30, pool=pool)
    step([first], 12)
    first.publish(tokens)  # sliding groups released blocks 0..2 (positions < 7): not published
    assert first.published == 6
    again = PagedKVCache(HYBRID, 30, pool=pool)
    assert again.reuse_prefix(tokens[:13]) == 12  # blocks 3..5 of the sliding groups cover 12 - 6 ..
    assert again.tables[0] == first.tables[0]
    short = PagedKVCache(HYBRID, 30, pool=pool)
    assert short.reuse_prefix(tokens[:9]) == 0  # 4 blocks need sliding blocks 1..3, released
    ours, theirs = step([again, first.fork()], 1)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


PROMPT = ("The paged cache keeps keys and values in blocks that many sequences share, and it must "
          "generate exactly what the preallocated cache generates, token for token.")


def greedy(model, ids: list[int], cache, n: int) -> list[int]:
    logits = model.prefill(np.array(ids), cache)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        if len(out) < n:
            logits = model.decode(out[-1], cache.length, cache)
    return out


@pytest.mark.parametrize("dtype", PAGED_DTYPES)
def test_smollm2_paged_generates_what_prealloc_generates_in_every_element_type(engine, dtype):
    ids = engine.tokenizer.encode(PROMPT)
    assert 30 <= len(ids) <= 50
    g = engine.config.kv_geometry
    runs = [greedy(engine.model, ids, make_cache(layout, g, len(ids) + 12, dtype), 12)
            for layout in ("prealloc", "paged")]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("dtype", ["f32", "q8_0", *GROUPED])
def test_gemma3_paged_generates_what_prealloc_generates(gemma_engine, dtype):
    """With the model's own window (512), and with its sliding layers' window cut to 8 in both caches
    (the cache decides what a layer sees), so that blocks are released as the sequence goes on."""
    ids = gemma_engine.tokenizer.encode(PROMPT)
    g = gemma_engine.config.kv_geometry
    assert g.sliding
    short = replace(g, windows=tuple(None if w is None else 8 for w in g.windows))
    for geometry in (g, short):
        paged = make_cache("paged", geometry, len(ids) + 12, dtype, block_size=4)
        runs = [greedy(gemma_engine.model, ids, cache, 12)
                for cache in (make_cache("prealloc", geometry, len(ids) + 12, dtype), paged)]
        assert runs[0] == runs[1]
        if geometry is short:
            sliding = [t for t, group in zip(paged.tables, paged.groups, strict=True) if group.window]
            first = first_held(dtype, paged.length, 8) // 4
            assert all(sum(b != HOLE for b in t) == -(-paged.length // 4) - first for t in sliding)


def held_rows(cache, layer: int, start: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows of positions start .. cache.length - 1 as the layout holds them."""
    if isinstance(cache, PagedKVCache):  # a sliding group released the blocks before its window
        return cache.state.read(layer, start, cache.length, *cache._state_rows(layer))
    keys, values = cache.read(layer)
    return keys[start:], values[start:]


@pytest.mark.parametrize("dtype", GROUPED)
def test_grouped_types_attend_over_a_sliding_window_as_float_attention_over_their_rows(dtype):
    """The grouped kernels leave out the positions before a sliding layer's window (q4_kivi: the first
    ones of a key group, q4_recent: a segment's): equal to float attention over the rows they hold."""
    from inferno.kernels.attention import attention_decode

    for cache in (make_cache("prealloc", WIDE, 320, dtype), make_cache("paged", WIDE, 320, dtype)):
        for n in (200, 1, 97):
            feed(cache, n)
        q = RNG.standard_normal(WIDE.heads * WIDE.head_dim, dtype=np.float32)
        for layer in range(WIDE.layers):
            keys, values = held_rows(cache, layer, max(cache.length - (WIDE.window(layer) or 10**9), 0))
            np.testing.assert_allclose(cache.attend(layer, q, cache.length),
                                       attention_decode(q, keys, values, WIDE.heads), rtol=1e-4, atol=2e-6)
