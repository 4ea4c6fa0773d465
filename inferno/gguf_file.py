"""Opening a GGUF file: every way a file can be wrong becomes one clear InfernoError.

The `gguf` package's reader memory-maps the file, so opening costs no copy of the weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from inferno.errors import InfernoError

GGUF_MAGIC = b"GGUF"


class _PlainMapReader(GGUFReader):
    """GGUFReader parsing through a plain ndarray view of its memory map.

    Same bytes, same mapping; but slicing an np.memmap runs Python hooks on every slice, and the
    reader slices about a million times for a 49k-token vocabulary: this view parses ~3x faster.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._data = np.asarray(mapped)


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """Open and validate `path`; raise InfernoError naming the problem if it is not a usable GGUF."""
    path = Path(path)
    if not path.exists():
        raise InfernoError(f"{path}: no such file")
    if path.is_dir():
        raise InfernoError(f"{path}: is a directory, not a GGUF file")
    size = path.stat().st_size
    if size == 0:
        raise InfernoError(f"{path}: file is empty")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise InfernoError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = _PlainMapReader(path)
    except Exception as exc:  # the reader raises many kinds on a cut-off header
        raise InfernoError(f"{path}: truncated or corrupt GGUF ({type(exc).__name__}: {exc})") from None
    for tensor in reader.tensors:
        if int(tensor.data_offset) + int(tensor.n_bytes) > size:
            raise InfernoError(f"{path}: truncated GGUF (tensor {tensor.name} runs past the end of the file)")
    return reader


def metadata(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The value stored under `key` (a Python scalar, str or list), or `default` when absent."""
    field = reader.get_field(key)
    if field is None:
        return default
    return field.contents()


def architecture(reader: GGUFReader) -> str:
    arch = metadata(reader, "general.architecture")
    if not isinstance(arch, str):
        raise InfernoError("GGUF metadata has no general.architecture")
    return arch
