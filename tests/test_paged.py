"""The paged cache: blocks, reference counts, copy-on-write, prefix reuse, attention through block tables."""

from __future__ import annotations

import numpy as np
import pytest

from inferno.kernels import attention
from inferno.kv import KVCacheFullError, KVGeometry, make_cache
from inferno.kv.paged import PagedKVCache
from inferno.kv.pool import BlockPool

GEOMETRY = KVGeometry(layers=2, kv_heads=2, heads=6, head_dim=8)
RNG = np.random.default_rng(13)


def rows(n: int) -> tuple[np.ndarray, np.ndarray]:
    k = RNG.standard_normal((n, GEOMETRY.kv_width), dtype=np.float32)
    return k, RNG.standard_normal((n, GEOMETRY.kv_width), dtype=np.float32)


def fill(cache, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """n tokens written to every layer and committed; the rows of each layer."""
    written = [rows(n) for _ in range(GEOMETRY.layers)]
    for layer, (k, v) in enumerate(written):
        cache.write(layer, cache.length, k, v)
    cache.commit(n)
    return written


def test_rows_read_back_across_blocks_and_blocks_come_as_needed():
    cache = PagedKVCache(GEOMETRY, 40, block_size=16)
    assert cache.pool.n_blocks == 3 and cache.nbytes == 0
    first = fill(cache, 5)
    second = fill(cache, 20)  # crosses into the second block
    assert len(cache.table) == 2 and cache.pool.used_blocks == 2
    for layer in range(GEOMETRY.layers):
        keys, values = cache.read(layer)
        np.testing.assert_array_equal(keys, np.concatenate([first[layer][0], second[layer][0]]))
        np.testing.assert_array_equal(values, np.concatenate([first[layer][1], second[layer][1]]))
    assert cache.nbytes == 2 * GEOMETRY.nbytes(16, 4)


def test_attention_through_the_block_table_matches_attention_over_contiguous_rows():
    cache = PagedKVCache(GEOMETRY, 300, block_size=16)
    fill(cache, 300)  # three decode spans, blocks in a scrambled order below
    cache.table_array = cache.table_array[::-1].copy()
    cache.pool.keys[:, :, :] = cache.pool.keys[:, ::-1]
    cache.pool.values[:, :, :] = cache.pool.values[:, ::-1]
    cache.table = cache.table_array.tolist()
    q = RNG.standard_normal(GEOMETRY.heads * GEOMETRY.head_dim, dtype=np.float32)
    for end in (1, 17, 128, 300):
        keys, values = cache.read(1, end)
        expected = attention.attention_decode(q, np.ascontiguousarray(keys), np.ascontiguousarray(values), 6)
        np.testing.assert_allclose(cache.attend(1, q, end), expected, rtol=1e-5, atol=1e-6)


def test_forks_share_blocks_and_copy_the_partial_one_on_write():
    pool = BlockPool(GEOMETRY, 8, block_size=4)
    parent = PagedKVCache(GEOMETRY, 12, pool=pool)
    prompt = fill(parent, 6)  # one full block, one with 2 of 4 rows
    child = parent.fork()
    assert child.table == parent.table and pool.refs[parent.table].tolist() == [2, 2]
    own = fill(child, 1)  # the shared partial block is copied before the write
    assert child.table[0] == parent.table[0] and child.table[1] != parent.table[1]
    assert pool.refs[parent.table].tolist() == [2, 1] and pool.used_blocks == 3
    keys, _ = child.read(0)
    np.testing.assert_array_equal(keys, np.concatenate([prompt[0][0], own[0][0]]))
    np.testing.assert_array_equal(parent.read(0)[0], prompt[0][0])  # the parent's rows are untouched
    fill(parent, 1)  # the parent is now the only holder of its partial block: written in place
    assert pool.used_blocks == 3
    child.reset()
    parent.reset()
    assert pool.used_blocks == 0 and pool.free_blocks == 8


def test_published_blocks_are_reused_by_a_prompt_with_the_same_prefix():
    pool = BlockPool(GEOMETRY, 8, block_size=4)
    first = PagedKVCache(GEOMETRY, 12, pool=pool)
    tokens = list(range(100, 110))
    fill(first, 10)
    first.publish(tokens)
    assert first.published == 2
    same_start = PagedKVCache(GEOMETRY, 12, pool=pool)
    assert same_start.reuse_prefix([*tokens[:8], 7, 7]) == 8
    assert same_start.table == first.table[:2]
    np.testing.assert_array_equal(same_start.read(1)[0], first.read(1, 8)[0])
    other = PagedKVCache(GEOMETRY, 12, pool=pool)
    assert other.reuse_prefix([*tokens[:4], 0, *tokens[5:]]) == 4  # the second block differs
    whole = PagedKVCache(GEOMETRY, 12, pool=pool)
    assert whole.reuse_prefix(tokens[:8]) == 4  # its last token is always left to prefill
    for cache in (first, same_start, other, whole):
        cache.reset()
    # No sequence holds them any more, but their contents stay findable until the pool needs them.
    assert pool.used_blocks == 0
    assert PagedKVCache(GEOMETRY, 12, pool=pool).reuse_prefix(tokens) == 8


def test_a_full_pool_is_refused_not_wrapped():
    cache = make_cache("paged", GEOMETRY, 5, block_size=4)
    fill(cache, 5)
    with pytest.raises(KVCacheFullError, match="sized for 5"):
        fill(cache, 1)
    pool = BlockPool(GEOMETRY, 1, block_size=4)
    a, b = PagedKVCache(GEOMETRY, 4, pool=pool), PagedKVCache(GEOMETRY, 4, pool=pool)
    fill(a, 2)
    with pytest.raises(KVCacheFullError, match="pool is full"):
        fill(b, 1)


def test_paged_generates_what_prealloc_generates(engine):
    prompt = engine.tokenizer.encode("The capital of France is")
    runs = {kv: engine.generate("The capital of France is", 24, kv=kv, ignore_eos=True)
            for kv in ("prealloc", "paged")}
    assert runs["paged"].token_ids == runs["prealloc"].token_ids
    held = -(-(len(prompt) + 23) // 16) * 16
    assert runs["paged"].metrics.cache_bytes == engine.config.kv_geometry.nbytes(held, 4)
