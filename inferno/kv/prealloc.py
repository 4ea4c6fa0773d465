"""`--kv prealloc`: K and V buffers for the whole capacity, allocated once and written in place."""

from __future__ import annotations

import math
import mmap

import numpy as np

from inferno.kv.base import KVCache
from inferno.kv.geometry import KVGeometry

ITEMSIZE = np.dtype(np.float32).itemsize


class PreallocKVCache(KVCache):
    """Writes into K and V buffers of [layers, capacity, kv_width] allocated once; reset keeps them."""

    kind = "prealloc"

    def __init__(self, geometry: KVGeometry, capacity: int):
        super().__init__(geometry, capacity)
        shape = (geometry.layers, capacity, geometry.kv_width)
        self.keys = lazy_zeros(shape)  # float32 [layers, capacity, kv_width]
        self.values = lazy_zeros(shape)

    @classmethod
    def planned_nbytes(cls, geometry: KVGeometry, capacity: int) -> int:
        return geometry.nbytes(capacity, ITEMSIZE)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def _store(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self.keys[layer, pos : pos + k.shape[0]] = k
        self.values[layer, pos : pos + v.shape[0]] = v

    def _rows(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        return self.keys[layer, :end], self.values[layer, :end]

    def _clear(self) -> None:
        pass  # stale rows past `length` are never read


def lazy_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """float32 zeros in fresh anonymous memory, made resident page by page (4 KiB) as rows are written.

    np.zeros would do the same, except that numpy asks Linux for transparent huge pages on large
    arrays: the first row written in each layer then makes 2 MiB resident, 120 MiB for a 4096-token
    SmolLM2 cache holding 36 tokens.
    """
    count = math.prod(shape)
    return np.frombuffer(mmap.mmap(-1, max(4 * count, 1)), np.float32, count).reshape(shape)
