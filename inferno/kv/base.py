"""The KV cache protocol every layout implements.

Every layer's attention needs the keys and values of all earlier tokens. A cache keeps them so a
decode step computes K and V for its one new token only. K is stored after RoPE, so a cached row
never needs rotating again.

Writing is two-phase: `write` puts a layer's rows at an explicit position, and `commit` advances the
committed `length` once every layer has written them, so a half-written token is never visible to
a reader of the committed state (`read` with no end, snapshots, `kv-inspect`).

A layout implements `_store`, `_rows`, `_clear` and `nbytes` (and `planned_nbytes`, what it allocates for
a capacity, which kv-memcalc prints); `attend` is the decode step's attention over the cache, which a
layout storing rows in another element type can compute on its own rows.

The element type of the rows (`dtype`, see `inferno.kv.dtypes`) is a choice separate from the layout:
a layout lists the ones it can hold in `dtypes`. `stored_rows` / `write_stored` move rows as they are
stored (a snapshot of a q8_0 cache holds its blocks, not floats rounded twice).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from inferno.errors import InfernoError
from inferno.kernels import attention
from inferno.kv.dtypes import F32, ElementType, element_type
from inferno.kv.geometry import KVGeometry


class KVCacheFullError(InfernoError):
    """A write would go past the cache's capacity; only a layout that `evicts` ever drops a row."""


class KVCache(ABC):
    """Keys and values of every layer, rows [token, kv_width] in float32."""

    layout: ClassVar[str]
    # A layout that evicts old positions to make room never refuses for length, may run past the
    # model's context, and may move keys to other positions: it is given the model's RoPE.
    evicts: ClassVar[bool] = False
    dtypes: ClassVar[tuple[str, ...]] = (F32,)  # element types this layout can hold

    def __init__(self, geometry: KVGeometry, capacity: int, dtype: str = F32):
        if capacity < 1:
            raise InfernoError(f"a KV cache needs room for at least one token, got {capacity}")
        self.dtype: ElementType = self.element_type(dtype)
        self.dtype.row_items(geometry)  # refuses a geometry the element type cannot store
        self.geometry = geometry
        self.capacity = capacity
        self.length = 0  # committed tokens
        self._written = [0] * geometry.layers  # rows each layer holds, committed or not

    @property
    def n_layers(self) -> int:
        return self.geometry.layers

    @property
    def kv_width(self) -> int:
        return self.geometry.kv_width

    @classmethod
    def element_type(cls, dtype: str) -> ElementType:
        """The element type `dtype` names, refused when this layout cannot hold it."""
        if dtype not in cls.dtypes:
            element_type(dtype)  # an unknown name gets the list of every element type
            raise InfernoError(
                f"a {cls.layout} cache holds {', '.join(cls.dtypes)} rows, not {dtype} "
                "(prealloc, window and paged hold any)"
            )
        return element_type(dtype)

    @classmethod
    @abstractmethod
    def planned_nbytes(cls, geometry: KVGeometry, capacity: int, dtype: str = F32) -> int:
        """Bytes a cache of this layout holds for keys and values when `capacity` tokens are in it."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held for keys and values right now."""

    @abstractmethod
    def _store(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None: ...

    @abstractmethod
    def _rows(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]: ...

    @abstractmethod
    def _clear(self) -> None: ...

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store rows k, v [n, kv_width] of `layer` at positions pos .. pos + n - 1."""
        self._check_write(layer, pos, k.shape[0])
        self._store(layer, pos, k, v)
        self._written[layer] = pos + k.shape[0]

    def write_stored(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        """`write` of rows already in this cache's element type (from `stored_rows` of a cache like it)."""
        self._check_write(layer, pos, k.shape[0])
        self._store_stored(layer, pos, k, v)
        self._written[layer] = pos + k.shape[0]

    def stored_rows(self, layer: int, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`read`, but the rows as stored in the cache's element type: [n, dtype.row_items]."""
        return self.read(layer, end)

    def _store_stored(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self._store(layer, pos, k, v)  # float32 rows are stored as they are

    def _check_write(self, layer: int, pos: int, n: int) -> None:
        self._check_room(layer, pos, n)
        if pos != self._written[layer]:
            held = self._written[layer]
            raise ValueError(f"layer {layer} holds {held} rows; rows go at the end, not at {pos}")

    def _check_room(self, layer: int, pos: int, n: int) -> None:
        if pos + n > self.capacity:
            raise KVCacheFullError(
                f"KV cache is full: {n} token(s) at position {pos} need {pos + n} slots, "
                f"it was sized for {self.capacity}"
            )

    def commit(self, n_tokens: int) -> None:
        """Make the last n_tokens visible; every layer must have written them."""
        target = self.length + n_tokens
        if any(written != target for written in self._written):
            raise ValueError(f"commit of {n_tokens} token(s) before every layer wrote them: {self._written}")
        self.length = target

    def read(self, layer: int, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of positions 0 .. end - 1 (default: the committed length).

        The model reads past the committed length only for the token it is writing right now.
        """
        end = self.length if end is None else end
        if end > self._written[layer]:
            raise ValueError(f"layer {layer} holds {self._written[layer]} rows, {end} asked for")
        return self._rows(layer, end)

    def layer_length(self, layer: int) -> int:
        """Rows `layer` holds, committed or not (the committed count of every layer is `length`)."""
        return self._written[layer]

    def head_rows(self, layer: int, head: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of one KV head at committed positions start .. end - 1: float32 [end - start, head_dim].

        Bounds are checked against what is committed, so a reader never sees a stale or half-written row.
        """
        g = self.geometry
        if not 0 <= layer < g.layers:
            raise IndexError(f"layer {layer} does not exist: the cache has layers 0..{g.layers - 1}")
        if not 0 <= head < g.kv_heads:
            raise IndexError(f"KV head {head} does not exist: the cache has KV heads 0..{g.kv_heads - 1}")
        if not 0 <= start <= end <= self.length:
            raise IndexError(f"positions {start}..{end} are outside the {self.length} committed")
        keys, values = self.read(layer, end)
        cols = slice(head * g.head_dim, (head + 1) * g.head_dim)
        return keys[start:end, cols], values[start:end, cols]

    def attend(self, layer: int, query: np.ndarray, end: int) -> np.ndarray:
        """One query row [heads * head_dim] attending over positions 0 .. end - 1 of `layer` (only
        the last `window` of them on a sliding-window layer)."""
        keys, values = self.read(layer, end)
        window = self.geometry.window(layer)
        if window is not None:
            keys, values = keys[-window:], values[-window:]
        return attention.attention_decode(query, keys, values, self.geometry.heads)

    def attend_new(self, layer: int, pos: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Prefill's attention: store rows k, v [T, kv_width] at pos.., then queries q [T, heads * head_dim]
        at the same positions attend causally over the cache; returns [T, heads * head_dim]."""
        self.write(layer, pos, k, v)
        keys, values = self.read(layer, pos + k.shape[0])
        return attention.attention_prefill(q, keys, values, self.geometry.heads, pos,
                                         window=self.geometry.window(layer))

    @property
    def evicted_tokens(self) -> int:
        """Committed positions some layer no longer holds (only a layout that `evicts` has any)."""
        return 0

    def truncate(self, length: int) -> int:
        """Forget every position from `length` on, written or committed (a chat turn edited, a forward
        interrupted): the positions kept. A layout whose stored rows depend on later ones (grouped element
        types, a window that slid, shared blocks) starts over instead: 0."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate to {length} of the {self.length} committed positions")
        if max(self._written) > length and not self._truncate(length):
            self.reset()
            return 0
        self.length = length
        self._written = [length] * self.n_layers
        return length

    def _truncate(self, length: int) -> bool:
        """Drop the rows past `length`, or say (False) that this layout cannot."""
        return False

    def reset(self) -> None:
        """Forget every token (memory is kept where the layout allows it)."""
        self.length = 0
        self._written = [0] * self.n_layers
        self._clear()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(length={self.length}, capacity={self.capacity}, "
                f"dtype={self.dtype.name}, nbytes={self.nbytes})")
