"""The KV cache protocol, for every layout: write, read, commit, reset, overflow, memory."""

from pathlib import Path

import numpy as np
import pytest

from inferno.errors import InfernoError
from inferno.file.config import ModelConfig
from inferno.kv import LAYOUTS, KVCacheFullError, KVGeometry, make_cache
from inferno.kv.basic import BasicKVCache
from inferno.kv.prealloc import PreallocKVCache

LAYERS, WIDTH = 3, 8
GEOMETRY = KVGeometry(layers=LAYERS, kv_heads=2, heads=4, head_dim=WIDTH // 2)
SMOLLM2 = KVGeometry(layers=30, kv_heads=3, heads=9, head_dim=64)
CLASSES = [cls for cls in LAYOUTS.values() if not cls.evicts]  # the window layout: tests/test_kv_window.py


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, WIDTH), dtype=np.float32)


def fill(cache, n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Write n tokens to every layer at the end of the cache, commit, return what was written."""
    pos = cache.length
    written = []
    for layer in range(LAYERS):
        k, v = rows(n, seed + 2 * layer), rows(n, seed + 2 * layer + 1)
        cache.write(layer, pos, k, v)
        written.append((k, v))
    cache.commit(n)
    return written


@pytest.mark.parametrize("layout", CLASSES)
def test_written_rows_read_back_exactly_in_order(layout):
    cache = layout(GEOMETRY, capacity=10)
    first = fill(cache, 4, seed=0)
    second = fill(cache, 1, seed=100)
    assert cache.length == 5
    for layer in range(LAYERS):
        k, v = cache.read(layer)
        assert k.shape == v.shape == (5, WIDTH)
        np.testing.assert_array_equal(k, np.concatenate([first[layer][0], second[layer][0]]))
        np.testing.assert_array_equal(v, np.concatenate([first[layer][1], second[layer][1]]))


@pytest.mark.parametrize("layout", CLASSES)
def test_uncommitted_rows_are_invisible_until_every_layer_wrote(layout):
    cache = layout(GEOMETRY, capacity=10)
    fill(cache, 2)
    cache.write(0, 2, rows(1, 7), rows(1, 8))
    assert cache.read(0)[0].shape[0] == 2  # committed view excludes the half-written token
    assert cache.read(0, 3)[0].shape[0] == 3  # the writer itself can see it
    with pytest.raises(ValueError, match="before every layer"):
        cache.commit(1)
    assert cache.length == 2


@pytest.mark.parametrize("layout", CLASSES)
def test_write_must_append(layout):
    cache = layout(GEOMETRY, capacity=10)
    fill(cache, 2)
    with pytest.raises(ValueError, match="not at 1"):
        cache.write(0, 1, rows(1, 0), rows(1, 1))


@pytest.mark.parametrize("layout", CLASSES)
def test_write_past_capacity_is_refused_and_changes_nothing(layout):
    cache = layout(GEOMETRY, capacity=4)
    fill(cache, 3)
    with pytest.raises(KVCacheFullError, match="sized for 4"):
        cache.write(0, 3, rows(2, 0), rows(2, 1))
    assert cache.length == 3
    assert cache.read(0)[0].shape[0] == 3
    fill(cache, 1)  # the last slot is still usable
    with pytest.raises(KVCacheFullError):
        cache.write(0, 4, rows(1, 0), rows(1, 1))


def test_cache_full_is_a_user_facing_error():
    assert issubclass(KVCacheFullError, InfernoError)


@pytest.mark.parametrize("layout", CLASSES)
def test_reset_forgets_tokens(layout):
    cache = layout(GEOMETRY, capacity=6)
    fill(cache, 5)
    cache.reset()
    assert cache.length == 0
    assert cache.read(1)[0].shape == (0, WIDTH)
    again = fill(cache, 2, seed=50)
    np.testing.assert_array_equal(cache.read(2)[1], again[2][1])


def test_prealloc_reset_keeps_its_buffers():
    cache = PreallocKVCache(GEOMETRY, capacity=6)
    buffers = cache.keys, cache.values
    fill(cache, 4)
    cache.reset()
    assert cache.keys is buffers[0] and cache.values is buffers[1]
    assert cache.nbytes == 2 * LAYERS * 6 * WIDTH * 4


def test_prealloc_layout_and_memory_is_the_formula():
    cache = PreallocKVCache(GEOMETRY, capacity=7)
    assert cache.keys.shape == cache.values.shape == (LAYERS, 7, WIDTH)
    assert cache.keys.dtype == np.float32
    assert cache.nbytes == 2 * LAYERS * 7 * WIDTH * 4
    written = fill(cache, 3)
    np.testing.assert_array_equal(cache.keys[1, :3], written[1][0])
    assert cache.nbytes == 2 * LAYERS * 7 * WIDTH * 4  # allocated up front, whatever the length


def resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_prealloc_memory_becomes_resident_only_as_rows_are_written():
    cache = PreallocKVCache(SMOLLM2, capacity=4096)  # SmolLM2's geometry: 180 MiB allocated
    before = resident_bytes()
    for layer in range(30):
        cache.write(layer, 0, np.ones((1, 192), np.float32), np.ones((1, 192), np.float32))
    cache.commit(1)
    assert cache.nbytes == 2 * 30 * 4096 * 192 * 4
    assert resident_bytes() - before < 2 << 20  # one 4 KiB page per layer and tensor, not a huge page


def test_basic_memory_grows_with_length_by_the_formula():
    cache = BasicKVCache(GEOMETRY, capacity=100)
    assert cache.nbytes == 0
    for length in (5, 6, 7):
        fill(cache, length - cache.length)
        assert cache.nbytes == 2 * LAYERS * length * WIDTH * 4


def test_basic_copies_history_on_every_write():
    cache = BasicKVCache(GEOMETRY, capacity=10)
    fill(cache, 2)
    before = cache.read(0)[0]
    fill(cache, 1)
    after = cache.read(0)[0]
    assert not np.shares_memory(before, after)  # concat_dim0 made a new array
    np.testing.assert_array_equal(after[:2], before)


CONFIG = ModelConfig(
    architecture="llama", n_layers=4, n_heads=8, n_kv_heads=2, head_dim=16, hidden_size=128, ffn_size=256,
    vocab_size=100, rope_base=10000.0, rope_dim=16, rope_neox=False, rms_eps=1e-5, context_length=64,
    tied_embeddings=True, qkv_bias=False, qk_norm=False, bos_id=None, eos_id=None,
)


@pytest.mark.parametrize("mode", list(LAYOUTS))
def test_factory_builds_each_kind_for_the_model(mode):
    cache = make_cache(mode, CONFIG.kv_geometry, 32, **({"window": 28, "positions": "original"}
                                                      if LAYOUTS[mode].evicts else {}))
    assert cache.layout == mode
    assert (cache.n_layers, cache.kv_width, cache.capacity) == (4, 32, 32)


def test_factory_refuses_unknown_kind_listing_valid_ones():
    with pytest.raises(InfernoError, match=r"'nonsense'.*basic, prealloc"):
        make_cache("nonsense", CONFIG.kv_geometry, 32)


@pytest.mark.parametrize("layout", CLASSES)
def test_planned_bytes_are_what_a_full_cache_holds(layout):
    cache = layout(GEOMETRY, capacity=5)
    fill(cache, 5)
    rows = 16 if layout.layout == "paged" else 5  # paged holds whole blocks of 16 tokens
    assert cache.nbytes == layout.planned_nbytes(GEOMETRY, 5) == 2 * LAYERS * rows * WIDTH * 4


@pytest.mark.parametrize("layout", CLASSES)
def test_head_rows_are_the_columns_of_one_kv_head_at_committed_positions(layout):
    cache = layout(GEOMETRY, capacity=8)
    written = fill(cache, 5)
    d = GEOMETRY.head_dim
    for layer in range(LAYERS):
        for head in range(GEOMETRY.kv_heads):
            k, v = cache.head_rows(layer, head, 1, 4)
            np.testing.assert_array_equal(k, written[layer][0][1:4, head * d : (head + 1) * d])
            np.testing.assert_array_equal(v, written[layer][1][1:4, head * d : (head + 1) * d])
    assert cache.head_rows(0, 0, 5, 5)[0].shape == (0, d)
    assert [cache.layer_length(layer) for layer in range(LAYERS)] == [5] * LAYERS


@pytest.mark.parametrize("layout", CLASSES)
@pytest.mark.parametrize(
    "layer, head, start, end, message",
    [
        (LAYERS, 0, 0, 1, "layer 3 does not exist"),
        (-1, 0, 0, 1, "layer -1 does not exist"),
        (0, 2, 0, 1, "KV head 2 does not exist"),
        (0, 0, 0, 4, r"0\.\.4 are outside the 3 committed"),  # row 3 is written but not committed
        (0, 0, 2, 1, r"2\.\.1 are outside"),
        (0, 0, -1, 2, r"-1\.\.2 are outside"),
    ],
)
def test_head_rows_refuses_what_is_not_committed(layout, layer, head, start, end, message):
    cache = layout(GEOMETRY, capacity=8)
    fill(cache, 3)
    cache.write(0, 3, rows(1, 0), rows(1, 1))  # half-written token: visible to no reader
    assert cache.layer_length(0) == 4 and cache.layer_length(1) == 3
    with pytest.raises(IndexError, match=message):
        cache.head_rows(layer, head, start, end)
