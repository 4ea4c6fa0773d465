"""The paged pool in every row element type, with sliding-window layer groups (Gemma 3's shape), and
the block accounting a scheduler reserves with (blocks_needed, prepare)."""

from __future__ import annotations

import numpy as np
import pytest

from inferno.errors import InfernoError
from inferno.kv import KVCacheFullError, KVGeometry, make_cache, planned_nbytes
from inferno.kv.batch import PagedBatch
from inferno.kv.paged import HOLE, PAGED_DTYPES, BlockPool, PagedKVCache, layer_groups

# 6 layers: 2 global, 4 sliding over 6 positions -> 3 groups of 2 layers (global, sliding, sliding)
HYBRID = KVGeometry(layers=6, kv_heads=2, heads=4, head_dim=64, windows=(None, 6, 6, None, 6, 6))
FLAT = KVGeometry(layers=2, kv_heads=2, heads=4, head_dim=64)
RNG = np.random.default_rng(3)


def rows(g: KVGeometry, n: int) -> tuple[np.ndarray, np.ndarray]:
    return (RNG.standard_normal((n, g.kv_width), dtype=np.float32),
            RNG.standard_normal((n, g.kv_width), dtype=np.float32))


def step(caches, n: int, queries: np.ndarray | None = None) -> list[list[np.ndarray]]:
    """n tokens into every cache (the same rows), then each layer's attention of a query at the last
    position in each cache (decode) or of the chunk's queries (prefill, attend_new)."""
    g = caches[0].geometry
    out: list[list[np.ndarray]] = [[] for _ in caches]
    for layer in range(g.layers):
        k, v = rows(g, n)
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
                assert len(held) <= group.window // bs + 2
                assert (paged.tables[g][0] == HOLE) == (paged.length + 1 - group.window >= bs)
    assert paged.pool.used_blocks == len(paged.held_blocks())
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
        allocated = cache.pool.keys.nbytes + cache.pool.values.nbytes
        assert planned_nbytes("paged", g, 50, dtype, block_size=16) == allocated == cache.pool.nbytes
        step([cache], 50)
        if not g.sliding:  # every block of the pool held: the rows at the element type's bytes
            assert cache.nbytes == allocated == 2 * g.layers * 64 * cache.dtype.row_bytes(g)


@pytest.mark.parametrize("dtype", ["q4_kivi", "q4_recent"])
def test_grouped_element_types_are_refused_in_one_line(dtype):
    held = "f32, f16, q8_0, q8_0h, q4_0, q4_0h"
    with pytest.raises(InfernoError, match=rf"a paged cache holds {held} rows, not {dtype}") as e:
        make_cache("paged", FLAT, 8, dtype)
    assert "\n" not in str(e.value)


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
    runs = [greedy(engine.model, ids, make_cache(kind, g, len(ids) + 12, dtype), 12)
            for kind in ("prealloc", "paged")]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_gemma3_paged_generates_what_prealloc_generates(gemma_engine, dtype):
    """With the model's own window (512), and with its sliding layers' window cut to 8 in both caches
    (the cache decides what a layer sees), so that blocks are released as the sequence goes on."""
    from dataclasses import replace

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
            assert all(sum(b != HOLE for b in t) <= 8 // 4 + 2 for t in sliding)
