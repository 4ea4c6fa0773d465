"""Several sequences advancing one token together (batched decoding): each writes its new K/V row at
its own position and attends over its own cache. `batch_of` picks how."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inferno.kv.base import KVCache, KVCacheFullError
from inferno.kv.paged import PagedKVCache, paged_attention


class CacheBatch:
    """Sequences in caches of any kind: one write and one attention call per sequence and layer."""

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
    """Sequences sharing one block pool: per layer, one scattered write and one attention kernel call
    for the whole batch. Blocks (a new one, or a private copy of a shared partial one) are taken once
    per step, before the first layer."""

    def __init__(self, caches: Sequence[PagedKVCache]):
        super().__init__(caches)
        self.pool = caches[0].pool
        bs = self.pool.block_size
        for cache, pos in zip(self.caches, self.positions.tolist(), strict=True):
            if pos + 1 > cache.capacity:
                raise KVCacheFullError(
                    f"KV cache is full: a token at position {pos} needs {pos + 1} slots, "
                    f"it was sized for {cache.capacity}"
                )
            cache.prepare(pos, pos + 1)
        self._blocks = np.array([c.table[p // bs] for c, p in zip(self.caches, self.positions, strict=True)])
        self._offsets = self.positions % bs
        self._tables = np.zeros((len(caches), max(len(c.table) for c in caches)), np.int32)
        for b, cache in enumerate(self.caches):
            self._tables[b, : len(cache.table)] = cache.table_array
        self._lengths = self.positions + 1

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self.pool.keys[layer, self._blocks, self._offsets] = k
        self.pool.values[layer, self._blocks, self._offsets] = v
        for cache in self.caches:
            cache._written[layer] += 1

    def attend(self, layer: int, q: np.ndarray, n_heads: int) -> np.ndarray:
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        return paged_attention(q, keys, values, self._tables, self._lengths, n_heads)


def batch_of(caches: Sequence[KVCache]) -> CacheBatch:
    """The batch for these caches: paged sequences of one pool decode as one; others one by one."""
    pools = {id(c.pool) for c in caches if isinstance(c, PagedKVCache)}
    if len(pools) == 1 and all(isinstance(c, PagedKVCache) for c in caches):
        return PagedBatch(caches)  # type: ignore[arg-type]
    return CacheBatch(caches)
