"""`--kv basic`: each layer's K and V grow by one copy of the whole history per write."""

from __future__ import annotations

import numpy as np

from inferno.kernels.ops import concat_dim0
from inferno.kv.base import KVCache
from inferno.kv.dtypes import F32
from inferno.kv.geometry import KVGeometry


class BasicKVCache(KVCache):
    """Grows each layer's K and V by one concat_dim0 per write: a full copy of the history every step.

    Simple and honest about its cost; capacity is only the limit it refuses to pass.
    """

    layout = "basic"

    def __init__(self, geometry: KVGeometry, capacity: int, dtype: str = F32):
        super().__init__(geometry, capacity, dtype)
        self._clear()

    @classmethod
    def planned_nbytes(cls, geometry: KVGeometry, capacity: int, dtype: str = F32) -> int:
        return cls.element_type(dtype).nbytes(geometry, capacity)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._keys) + sum(a.nbytes for a in self._values)

    def _store(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self._keys[layer] = concat_dim0(self._keys[layer], k)  # [written + n, kv_width]
        self._values[layer] = concat_dim0(self._values[layer], v)

    def _rows(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        return self._keys[layer][:end], self._values[layer][:end]

    def _truncate(self, length: int) -> bool:
        self._keys = [k[:length] for k in self._keys]
        self._values = [v[:length] for v in self._values]
        return True

    def _clear(self) -> None:
        empty = np.zeros((0, self.kv_width), dtype=np.float32)
        self._keys = [empty] * self.n_layers
        self._values = [empty] * self.n_layers
