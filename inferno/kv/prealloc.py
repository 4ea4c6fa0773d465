"""`--kv prealloc`: K and V buffers for the whole capacity, allocated once and written in place."""

from __future__ import annotations

import numpy as np

from inferno.kv.base import KVCache
from inferno.kv.dtypes import DTYPES, F32, RowStore
from inferno.kv.geometry import KVGeometry
from inferno.kv.memory import lazy_zeros

__all__ = ["PreallocKVCache", "lazy_zeros"]


class PreallocKVCache(KVCache):
    """Writes into buffers for the whole capacity allocated once; reset keeps them.

    With a row element type they are K and V of [layers, capacity, row]: kv_width float32 values, or
    their encoded form (e.g. q8_0 blocks), which decode attention reads directly. The element type
    owns the buffers (`make_store`), so one that groups positions (q4_kivi) fits as well.
    """

    layout = "prealloc"
    dtypes = tuple(DTYPES)

    def __init__(self, geometry: KVGeometry, capacity: int, dtype: str = F32):
        super().__init__(geometry, capacity, dtype)
        self.store = self.dtype.make_store(geometry, capacity)

    @property
    def keys(self) -> np.ndarray:
        """K of a row element type, [layers, capacity, row]."""
        return self.store.keys

    @property
    def values(self) -> np.ndarray:
        return self.store.values

    @classmethod
    def planned_nbytes(cls, geometry: KVGeometry, capacity: int, dtype: str = F32) -> int:
        return cls.element_type(dtype).nbytes(geometry, capacity)

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def _store(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self.store.write(layer, pos, k, v)

    def _store_stored(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self.store.write_stored(layer, pos, k, v)

    def _rows(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        return self.store.read(layer, end)

    def stored_rows(self, layer: int, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        end = self.length if end is None else end
        if end > self._written[layer]:
            raise ValueError(f"layer {layer} holds {self._written[layer]} rows, {end} asked for")
        return self.store.stored(layer, end)

    def attend(self, layer: int, query: np.ndarray, end: int) -> np.ndarray:
        window = self.geometry.window(layer)  # a sliding layer attends over its last `window` positions
        return self.store.attend(layer, query, end, 0 if window is None else max(end - window, 0))

    def _clear(self) -> None:
        self.store.clear()

    def _truncate(self, length: int) -> bool:
        return type(self.store) is RowStore  # one row a position: later rows are stale, never read
