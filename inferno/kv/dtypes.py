"""Element types of cache rows, `--kv-dtype`: a choice separate from the layout (`--kv`).

Any layout that holds rows in place stores them through an ElementType: it knows a row's size in
bytes (blocks with their scales), encodes float32 rows as they are written, decodes them for readers,
and runs decode attention on the stored rows directly (`inferno.kv.blocks`), with no float copy of
the cache per step.

    f32      float32, the reference: what the model computes, unchanged
    f16      IEEE half
    q8_0     llama.cpp's q8_0: blocks of 32 values along head_dim, int8 and an f16 scale (8.5 bits)
    q8_0h    q8_0 blocks of Hadamard-rotated heads (8.5 bits): a quarter of q8_0's loss measured
             against the float cache, at the same bytes and speed
    q4_0     llama.cpp's q4_0: blocks of 32, 4-bit and an f16 scale (4.5 bits)
    q4_0h    q4_0 blocks of Hadamard-rotated heads (4.5 bits): same bytes per row as q4_0, closer
             to the float cache because a key's few huge channels no longer set every scale
    q4_kivi  KIVI: keys in 4 bits per channel over groups of 64 positions (an f16 scale and minimum
             each), values as q4_0h; the open group's rows in f16 until it is full (`inferno.kv.kivi`)
    q4_recent  4 bits per rotated head of 64 values, keys minus a mean per segment, and the newest
             positions in q8_0 as well (`inferno.kv.recent`): 4.48 bits a value at 512 tokens

Where rows are kept is the element type's too (`make_store`): a row type's are [layers, capacity,
row] buffers; q4_kivi's group keys by channel and q4_recent keeps two forms of its newest rows, so a
layout asks the element type for its store.

`ELEMENT_TYPES` also lists bf16 and fp8, which inferno's caches do not hold: kv-memcalc sizes vLLM's
and SGLang's caches in them from the same table. `DTYPES` is what the caches hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inferno.errors import InfernoError
from inferno.kv import blocks, kivi, recent
from inferno.kv.geometry import KVGeometry
from inferno.kv.memory import lazy_zeros

F32 = "f32"


@dataclass(frozen=True)
class ElementType:
    name: str
    block_values: int  # values stored together: 1 for plain floats, 32 for q8_0 / q4_0
    block_bytes: int  # bytes of one block, its scale included
    fmt: int | None  # the stored format in `inferno.kv.blocks`; None: float32 rows as computed
    rotate: bool = False  # heads are Hadamard-rotated before they are rounded
    held: bool = True  # inferno's caches can hold it; False: sized for other engines only (bf16, fp8)

    @property
    def bits_per_value(self) -> float:
        return 8 * self.block_bytes / self.block_values

    def blocks_bytes(self, values: int) -> int:
        """Bytes of `values` values, a whole number of blocks (the caller checks): scales included."""
        return values // self.block_values * self.block_bytes

    @property
    def storage(self) -> type[np.generic]:
        """The numpy type of a stored row's items: float32 rows, or bytes."""
        return np.float32 if self.fmt is None else np.uint8

    def row_items(self, geometry: KVGeometry) -> int:
        """Items of `storage` in one token's K (or V) row of one layer."""
        if geometry.head_dim % self.block_values:
            raise InfernoError(
                f"{self.name} stores blocks of {self.block_values} values along head_dim, "
                f"which does not divide this model's head_dim of {geometry.head_dim}"
            )
        if self.rotate and geometry.head_dim & (geometry.head_dim - 1):
            raise InfernoError(f"{self.name} rotates heads, which needs a power-of-two head_dim, "
                               f"not {geometry.head_dim}")
        return self.blocks_bytes(geometry.kv_width) // np.dtype(self.storage).itemsize

    def row_bytes(self, geometry: KVGeometry) -> int:
        return self.row_items(geometry) * np.dtype(self.storage).itemsize

    def nbytes(self, geometry: KVGeometry, tokens: int) -> int:
        """Bytes of K and V for `tokens` tokens in every layer."""
        return 2 * geometry.layers * tokens * self.row_bytes(geometry)

    def encode(self, rows: np.ndarray, geometry: KVGeometry) -> np.ndarray:
        """float32 rows [n, kv_width] as stored: [n, row_items] of `storage`."""
        if self.fmt is None:
            return rows
        out = np.empty((rows.shape[0], self.row_items(geometry)), np.uint8)
        if self.rotate:
            rows = rows.copy()
            blocks.hadamard_rows(rows, geometry.head_dim)
        blocks.encode_rows(np.ascontiguousarray(rows, dtype=np.float32), self.fmt, out)
        return out

    def decode(self, stored: np.ndarray, geometry: KVGeometry) -> np.ndarray:
        """Stored rows [n, row_items] back to float32 [n, kv_width]."""
        if self.fmt is None:
            return stored
        out = np.empty((stored.shape[0], geometry.kv_width), np.float32)
        blocks.decode_rows(np.ascontiguousarray(stored), self.fmt, out)
        if self.rotate:
            blocks.hadamard_rows(out, geometry.head_dim)  # its own inverse
        return out

    def attend(
        self, query: np.ndarray, keys: np.ndarray, values: np.ndarray, geometry: KVGeometry, start: int = 0,
        end: int | None = None,
    ) -> np.ndarray:
        """Decode attention of one query row [heads * head_dim] over stored rows start .. end - 1 of
        keys, values (default: all of them), read where they are (blocks.attend_tables)."""
        end = keys.shape[0] if end is None else end
        return blocks.attend_rows(query, keys, values, start, end, geometry.heads, self.kernel_fmt,
                                  self.rotate)

    @property
    def kernel_fmt(self) -> int:
        """The row format attention reads (blocks.FMT_F32 for float32 rows)."""
        return blocks.FMT_F32 if self.fmt is None else self.fmt

    def make_store(self, geometry: KVGeometry, capacity: int) -> RowStore:
        """Buffers for `capacity` tokens of every layer, in this element type."""
        return RowStore(self, geometry, capacity)


class RowStore:
    """K and V of [layers, capacity, row] in one element type: each position's row on its own."""

    def __init__(self, dtype: ElementType, geometry: KVGeometry, capacity: int):
        self.dtype, self.geometry = dtype, geometry
        shape = (geometry.layers, capacity, dtype.row_items(geometry))
        self.keys = lazy_zeros(shape, dtype.storage)
        self.values = lazy_zeros(shape, dtype.storage)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        g = self.geometry
        self.write_stored(layer, pos, self.dtype.encode(k, g), self.dtype.encode(v, g))

    def write_stored(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self.keys[layer, pos : pos + k.shape[0]] = k
        self.values[layer, pos : pos + v.shape[0]] = v

    def stored(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        return self.keys[layer, :end], self.values[layer, :end]

    def read(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        keys, values = self.stored(layer, end)
        return self.dtype.decode(keys, self.geometry), self.dtype.decode(values, self.geometry)

    def attend(self, layer: int, query: np.ndarray, end: int, start: int = 0) -> np.ndarray:
        return self.dtype.attend(query, self.keys[layer], self.values[layer], self.geometry, start, end)

    def clear(self) -> None:
        pass  # stale rows past the cache's length are never read


@dataclass(frozen=True)
class KiviType(ElementType):
    """q4_kivi. Snapshots hold its rows as float32 (its keys have no per-position form), which it
    encodes again on loading; its size is the store's: groups, plus the open group in f16."""

    def row_items(self, geometry: KVGeometry) -> int:
        ElementType("q4_0h", blocks.BLOCK, 18, blocks.FMT_Q4_0, rotate=True).row_items(geometry)  # its values
        return geometry.kv_width

    def nbytes(self, geometry: KVGeometry, tokens: int) -> int:
        return kivi.planned_nbytes(geometry, tokens)

    def make_store(self, geometry: KVGeometry, capacity: int) -> kivi.KiviStore:
        self.row_items(geometry)
        return kivi.KiviStore(geometry, capacity)


@dataclass(frozen=True)
class RecentType(ElementType):
    """q4_recent. Snapshots hold its rows as float32, which it rounds again on loading; its size is
    the store's: the 4-bit body, the q8_0 ring and the key means."""

    def row_items(self, geometry: KVGeometry) -> int:
        recent.check_geometry(geometry)
        return geometry.kv_width

    def nbytes(self, geometry: KVGeometry, tokens: int) -> int:
        return recent.planned_nbytes(geometry, tokens)

    def make_store(self, geometry: KVGeometry, capacity: int) -> recent.RecentStore:
        return recent.RecentStore(geometry, capacity)


ELEMENT_TYPES: dict[str, ElementType] = {
    t.name: t
    for t in (
        ElementType(F32, 1, 4, None),
        ElementType("f16", 1, 2, blocks.FMT_F16),
        ElementType("bf16", 1, 2, None, held=False),
        ElementType("fp8", 1, 1, None, held=False),  # e4m3 or e5m2: one byte a value either way
        ElementType("q8_0", blocks.BLOCK, 34, blocks.FMT_Q8_0),
        ElementType("q8_0h", blocks.BLOCK, 34, blocks.FMT_Q8_0, rotate=True),
        ElementType("q4_0", blocks.BLOCK, 18, blocks.FMT_Q4_0),
        ElementType("q4_0h", blocks.BLOCK, 18, blocks.FMT_Q4_0, rotate=True),
        KiviType("q4_kivi", kivi.GROUP, kivi.GROUP // 2 + 4, None, rotate=True),
        RecentType("q4_recent", recent.SCALED, recent.SCALED_BYTES, None, rotate=True),
    )
}
DTYPES: dict[str, ElementType] = {name: t for name, t in ELEMENT_TYPES.items() if t.held}


def element_type(name: str) -> ElementType:
    """The element type `name` names; unknown names are refused with the valid ones."""
    if name not in DTYPES:
        raise InfernoError(f"unknown KV cache element type {name!r} (valid: {', '.join(DTYPES)})")
    return DTYPES[name]
