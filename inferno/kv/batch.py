"""Several sequences advancing one token together (batched decoding): each writes its new K/V row at
its own position and attends over its own cache. `batch_of` picks how."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inferno.kv.base import KVCache, KVCacheFullError
from inferno.kv.blocks import attend_tables
from inferno.kv.paged import PagedKVCache


class CacheBatch:
    """Sequences in caches of any layout: one write and one attention call per sequence and layer."""

    def __init__(self, caches: Sequence[KVCache]):
        if not caches:
            raise ValueError("a batch needs at least one sequence")
        self.caches = list(caches)
        self.positions = np.array([c.length for c in caches], np.int64)  # of each sequence's new token

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Row b of k, v [B, kv_width] at sequence b's position."""
        for b, cache in enumerate(self.caches):
            cache.write(layer, int(self.positions[b]), k[b : b + 1], v[b : b + 1])

    def attend(self, layer: int, q: np.ndarray, n_heads: int) -> np.ndarray:
        """Query row b of q [B, heads * head_dim] over sequence b's positions, its new one included."""
        ends = (self.positions + 1).tolist()
        return np.stack([c.attend(layer, q[b], ends[b]) for b, c in enumerate(self.caches)])

    def commit(self) -> None:
        for cache in self.caches:
            cache.commit(1)


class PagedBatch(CacheBatch):
    """Sequences sharing one block pool: per layer, one scattered write and one call of the decode
    attention kernel (blocks.attend_tables) for the whole batch, in the pool's element type. Blocks (a
    new one, or a private copy of a shared partial one), in every layer group, are taken once per step,
    before the first layer."""

    def __init__(self, caches: Sequence[PagedKVCache]):
        super().__init__(caches)
        self.pool = pool = caches[0].pool
        bs = pool.block_size
        for cache, pos in zip(self.caches, self.positions.tolist(), strict=True):
            if pos + 1 > cache.capacity:
                raise KVCacheFullError(
                    f"KV cache is full: a token at position {pos} needs {pos + 1} slots, "
                    f"it was sized for {cache.capacity}"
                )
            cache.prepare(pos, pos + 1)
        self._offsets = self.positions % bs
        ends = (self.positions + 1).tolist()
        self._blocks, self._tables, self._ranges = [], [], []  # per layer group
        for g in range(len(pool.groups)):
            self._blocks.append(np.array([c.tables[g][p // bs] for c, p in zip(self.caches, self.positions,
                                                                               strict=True)]))
            tables = np.zeros((len(caches), max(len(c.tables[g]) for c in caches)), np.int32)
            for b, cache in enumerate(self.caches):
                tables[b, : len(cache.tables[g])] = cache.table_arrays[g]
            self._tables.append(tables)
            self._ranges.append(np.stack([c.attention_range(g, e) for c, e in zip(self.caches, ends,
                                                                                  strict=True)]))

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        pool, geometry = self.pool, self.pool.geometry
        group, slot = pool.slot_of[layer]
        pool.keys[slot, self._blocks[group], self._offsets] = pool.dtype.encode(k, geometry)
        pool.values[slot, self._blocks[group], self._offsets] = pool.dtype.encode(v, geometry)
        for cache in self.caches:
            cache._written[layer] += 1

    def attend(self, layer: int, q: np.ndarray, n_heads: int) -> np.ndarray:
        pool = self.pool
        group, slot = pool.slot_of[layer]
        return attend_tables(q, pool.key_rows[slot], pool.value_rows[slot], self._tables[group],
                             self._ranges[group], pool.block_size, n_heads, pool.dtype.kernel_fmt,
                             pool.dtype.rotate)


def batch_of(caches: Sequence[KVCache]) -> CacheBatch:
    """The batch for these caches: paged sequences of one pool decode as one; others one by one (and
    those of a pool of q4_recent or q4_kivi, whose rows are written and read with the sequence's state)."""
    pools = {id(c.pool) for c in caches if isinstance(c, PagedKVCache)}
    if len(pools) == 1 and all(isinstance(c, PagedKVCache) for c in caches) and not caches[0].pool.grouped:
        return PagedBatch(caches)  # type: ignore[arg-type]
    return CacheBatch(caches)
