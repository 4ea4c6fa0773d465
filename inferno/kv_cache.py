"""The KV cache: one small protocol, one class per way of storing the rows, and a factory.

Every layer's attention needs the keys and values of all earlier tokens. A cache keeps them so a
decode step computes K and V for its one new token only. K is stored after RoPE, so a cached row
never needs rotating again.

Writing is two-phase: `write` puts a layer's rows at an explicit position, and `commit` advances the
committed `length` once every layer has written them, so a half-written token is never visible to
a reader of the committed state (`read` with no end, snapshots, `kv-inspect`).
"""

from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from inferno.config import ModelConfig
from inferno.errors import InfernoError
from inferno.kernels import concat_dim0


class KVCacheFullError(InfernoError):
    """A write would go past the cache's capacity; nothing is ever wrapped around or dropped."""


class KVCache(ABC):
    """Keys and values of every layer, rows [token, kv_heads * head_dim] in float32."""

    kind: ClassVar[str]

    def __init__(self, n_layers: int, kv_width: int, capacity: int):
        if capacity < 1:
            raise InfernoError(f"a KV cache needs room for at least one token, got {capacity}")
        self.n_layers = n_layers
        self.kv_width = kv_width
        self.capacity = capacity
        self.length = 0  # committed tokens
        self._written = [0] * n_layers  # rows each layer holds, committed or not

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
        n = k.shape[0]
        if pos + n > self.capacity:
            raise KVCacheFullError(
                f"KV cache is full: {n} token(s) at position {pos} need {pos + n} slots, "
                f"it was sized for {self.capacity}"
            )
        if pos != self._written[layer]:
            held = self._written[layer]
            raise ValueError(f"layer {layer} holds {held} rows; rows go at the end, not at {pos}")
        self._store(layer, pos, k, v)
        self._written[layer] = pos + n

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

    def reset(self) -> None:
        """Forget every token (memory is kept where the kind allows it)."""
        self.length = 0
        self._written = [0] * self.n_layers
        self._clear()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(length={self.length}, capacity={self.capacity}, nbytes={self.nbytes})"


class BasicKVCache(KVCache):
    """Grows each layer's K and V by one concat_dim0 per write: a full copy of the history every step.

    Simple and honest about its cost; capacity is only the limit it refuses to pass.
    """

    kind = "basic"

    def __init__(self, n_layers: int, kv_width: int, capacity: int):
        super().__init__(n_layers, kv_width, capacity)
        self._clear()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._keys) + sum(a.nbytes for a in self._values)

    def _store(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self._keys[layer] = concat_dim0(self._keys[layer], k)
        self._values[layer] = concat_dim0(self._values[layer], v)

    def _rows(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        return self._keys[layer][:end], self._values[layer][:end]

    def _clear(self) -> None:
        empty = np.zeros((0, self.kv_width), dtype=np.float32)
        self._keys = [empty] * self.n_layers
        self._values = [empty] * self.n_layers


class PreallocKVCache(KVCache):
    """Writes into K and V buffers of [layers, capacity, kv_width] allocated once; reset keeps them."""

    kind = "prealloc"

    def __init__(self, n_layers: int, kv_width: int, capacity: int):
        super().__init__(n_layers, kv_width, capacity)
        self.keys = lazy_zeros((n_layers, capacity, kv_width))
        self.values = lazy_zeros((n_layers, capacity, kv_width))

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


KV_CACHE_KINDS: dict[str, type[KVCache]] = {cls.kind: cls for cls in (BasicKVCache, PreallocKVCache)}


def create_kv_cache(mode: str, config: ModelConfig, max_context: int) -> KVCache:
    """The cache `--kv mode` names, sized for max_context tokens of this model."""
    if mode not in KV_CACHE_KINDS:
        raise InfernoError(f"unknown KV cache mode {mode!r} (valid: {', '.join(KV_CACHE_KINDS)})")
    return KV_CACHE_KINDS[mode](config.n_layers, config.kv_width, max_context)
