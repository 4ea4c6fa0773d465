"""Element types of cache rows, `--kv-dtype`: a choice separate from the layout (`--kv`).

Any layout that holds rows in place stores them through an ElementType: it knows a row's size in
bytes (blocks with their scales), encodes float32 rows as they are written, decodes them for readers,
and runs decode attention on the stored rows directly (`inferno.kv.blocks`), with no float copy of
the cache per step.

    f32      float32, the reference: what the model computes, unchanged
    f16      IEEE half
    q8_0     llama.cpp's q8_0: blocks of 32 values along head_dim, int8 and an f16 scale (8.5 bits)
    q4_0     llama.cpp's q4_0: blocks of 32, 4-bit and an f16 scale (4.5 bits)
    q4_0h    q4_0 blocks of Hadamard-rotated heads (4.5 bits): same bytes per row as q4_0, much
             closer to the float cache because a key's few huge channels no longer set every scale
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inferno import kernels
from inferno.errors import InfernoError
from inferno.kv import blocks
from inferno.kv.geometry import KVGeometry

F32 = "f32"


@dataclass(frozen=True)
class ElementType:
    name: str
    block_values: int  # values stored together: 1 for plain floats, 32 for q8_0 / q4_0
    block_bytes: int  # bytes of one block, its scale included
    fmt: int | None  # the stored format in `inferno.kv.blocks`; None: float32 rows as computed
    rotate: bool = False  # heads are Hadamard-rotated before they are rounded

    @property
    def bits_per_value(self) -> float:
        return 8 * self.block_bytes / self.block_values

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
        blocks_per_row = geometry.kv_width // self.block_values
        return blocks_per_row * self.block_bytes // np.dtype(self.storage).itemsize

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
        self, query: np.ndarray, keys: np.ndarray, values: np.ndarray, geometry: KVGeometry
    ) -> np.ndarray:
        """Decode attention of one query row [heads * head_dim] over stored rows keys, values."""
        if self.fmt is None:
            return kernels.attention_decode(query, keys, values, geometry.heads)
        return blocks.attention_decode_rows(query, keys, values, geometry.heads, self.fmt, self.rotate)


DTYPES: dict[str, ElementType] = {
    t.name: t
    for t in (
        ElementType(F32, 1, 4, None),
        ElementType("f16", 1, 2, blocks.FMT_F16),
        ElementType("q8_0", blocks.BLOCK, 34, blocks.FMT_Q8_0),
        ElementType("q4_0", blocks.BLOCK, 18, blocks.FMT_Q4_0),
        ElementType("q4_0h", blocks.BLOCK, 18, blocks.FMT_Q4_0, rotate=True),
    )
}


def element_type(name: str) -> ElementType:
    """The element type `name` names; unknown names are refused with the valid ones."""
    if name not in DTYPES:
        raise InfernoError(f"unknown KV cache element type {name!r} (valid: {', '.join(DTYPES)})")
    return DTYPES[name]
