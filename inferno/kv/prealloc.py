"""`--kv prealloc`: K and V buffers for the whole capacity, allocated once and written in place."""

from __future__ import annotations

import math
import mmap

import numpy as np

from inferno.kv.base import KVCache
from inferno.kv.dtypes import DTYPES, F32
from inferno.kv.geometry import KVGeometry


class PreallocKVCache(KVCache):
    """Writes into K and V buffers of [layers, capacity, row] allocated once; reset keeps them.

    A row is kv_width float32 values, or with another element type its encoded form (e.g. q8_0
    blocks), which decode attention reads directly.
    """

    kind = "prealloc"
    dtypes = tuple(DTYPES)

    def __init__(self, geometry: KVGeometry, capacity: int, dtype: str = F32):
        super().__init__(geometry, capacity, dtype)
        shape = (geometry.layers, capacity, self.dtype.row_items(geometry))
        self.keys = lazy_zeros(shape, self.dtype.storage)  # [layers, capacity, row]
        self.values = lazy_zeros(shape, self.dtype.storage)

    @classmethod
    def planned_nbytes(cls, geometry: KVGeometry, capacity: int, dtype: str = F32) -> int:
        return cls.element_type(dtype).nbytes(geometry, capacity)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def _store(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        g = self.geometry
        self._store_stored(layer, pos, self.dtype.encode(k, g), self.dtype.encode(v, g))

    def _store_stored(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self.keys[layer, pos : pos + k.shape[0]] = k
        self.values[layer, pos : pos + v.shape[0]] = v

    def _rows(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        keys, values = self._stored(layer, end)
        return self.dtype.decode(keys, self.geometry), self.dtype.decode(values, self.geometry)

    def _stored(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        return self.keys[layer, :end], self.values[layer, :end]

    def stored_rows(self, layer: int, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        end = self.length if end is None else end
        if end > self._written[layer]:
            raise ValueError(f"layer {layer} holds {self._written[layer]} rows, {end} asked for")
        return self._stored(layer, end)

    def attend(self, layer: int, query: np.ndarray, end: int) -> np.ndarray:
        keys, values = self.stored_rows(layer, end)
        return self.dtype.attend(query, keys, values, self.geometry)

    def _clear(self) -> None:
        pass  # stale rows past `length` are never read


def lazy_zeros(shape: tuple[int, ...], dtype: type[np.generic] = np.float32) -> np.ndarray:
    """Zeros in fresh anonymous memory, made resident page by page (4 KiB) as rows are written.

    np.zeros would do the same, except that numpy asks Linux for transparent huge pages on large
    arrays: the first row written in each layer then makes 2 MiB resident, 120 MiB for a 4096-token
    SmolLM2 cache holding 36 tokens.
    """
    count = math.prod(shape)
    itemsize = np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(itemsize * count, 1)), dtype, count).reshape(shape)
