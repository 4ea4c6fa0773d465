"""A weight a forward only looks rows up in (an untied token embedding), read where the GGUF holds it.

A model whose output matrix is its own keeps the embedding only for lookups: a few rows a step, a
prompt's rows once. Repacking it into tiles, as the matrices are, would copy its every byte into the
prepared-model cache (an eighth of a 1.5B Q4_K_M file's) for rows that are read a handful at a time. So
its blocks stay in the file, memory-mapped, and a lookup lays out only the rows asked for as tiles and
dequantizes them with the matrices' own kernels: the same bits as `QuantizedMatrix.rows_at`, which
are gguf-py's.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from inferno.kernels.quant import QuantizedMatrix, matrix_shape, tile_layout
from inferno.kernels.repack import mapped_file, repack


class FileRows:
    """Rows of a GGUF weight, `rows_at` dequantizing any of them; its blocks are not copied."""

    def __init__(self, name: str, qtype: QType, cols: int, blocks: np.ndarray, offset: int | None = None):
        """blocks: uint8[rows, row bytes], the weight as the file holds it (usually a read-only mapping
        of it); offset: where they start in the model file (None: not in a file)."""
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != cols // block * type_size:
            raise ValueError(f"{name}: {blocks.dtype} {blocks.shape}: not rows of {cols} {qtype.name} values")
        self.name, self.qtype, self.cols, self.offset = name, qtype, cols, offset
        self.rows = blocks.shape[0]
        self._blocks = blocks.reshape(self.rows, cols // block, type_size)

    @classmethod
    def from_tensor(cls, tensor: gguf.ReaderTensor) -> FileRows:
        qtype, rows, cols = matrix_shape(tensor)
        blocks = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(rows, -1)
        place = mapped_file(tensor)
        return cls(tensor.name, qtype, cols, blocks, None if place is None else place[1])

    @classmethod
    def mapped(cls, path: str, name: str, qtype: QType, rows: int, cols: int, offset: int) -> FileRows:
        """The weight at byte `offset` of the file at `path` (ValueError: not a weight that fits there)."""
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if rows < 1 or cols < 1 or cols % block or offset < 0:
            raise ValueError(f"{name}: {rows} rows of {cols} {qtype.name} values at {offset}")
        # (a range past the file's end raises ValueError)
        blocks = np.memmap(path, np.uint8, "r", offset, (rows, cols // block * type_size))
        return cls(name, qtype, cols, blocks, offset)

    def rows_at(self, ids: np.ndarray) -> np.ndarray:
        """float32[len(ids), cols]: the rows `ids` dequantized (an embedding lookup)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.rows):
            raise IndexError(f"{self.name}: row ids must be in [0, {self.rows})")
        shape, parts = tile_layout(self.qtype, [max(ids.size, 1)], self.cols)
        tiles = np.empty(shape, np.uint8)
        repack(self._blocks[ids], tiles, int(self.qtype))
        matrix = QuantizedMatrix.from_tiles([self.name], self.qtype, self.cols, tiles, parts)
        return matrix.rows_at(np.arange(ids.size))
