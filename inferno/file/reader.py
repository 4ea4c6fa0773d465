"""Opening a GGUF file: every way a file can be wrong becomes one clear InfernoError.

The `gguf` package's reader memory-maps the file, so opening costs no copy of the weights.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField

from inferno.arguments import shown_path, special_file
from inferno.errors import InfernoError

GGUF_MAGIC = b"GGUF"


class _PlainMapReader(GGUFReader):
    """GGUFReader with the same fields and tensors, parsed many times faster.

    The stock reader walks metadata arrays element by element through generic helpers, and slices its
    np.memmap (which runs Python hooks on every slice) about a million times for a 49k-token vocabulary:
    a second of every start. Here the map is sliced as a plain ndarray view, and a flat array of strings
    or scalars becomes an _ArrayField: its items are located in one tight loop, and made into the
    stock reader's parts (two arrays a string) only if something asks for the parts.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._data = np.asarray(mapped)

    def _build_fields(self, offs: int, count: int) -> int:
        """The stock loop, but a flat array's field is an _ArrayField."""
        for _ in range(count):
            orig_offs = offs
            kv_klen, kv_kdata = self._get_str(offs)
            offs += int(kv_klen.nbytes + kv_kdata.nbytes)
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            head = [kv_klen, kv_kdata, raw_kv_type]
            name = str(bytes(kv_kdata), encoding="utf-8")
            field = self._flat_array(orig_offs, name, head, offs, raw_kv_type[0])
            if field is None:
                size, parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
                field = ReaderField(orig_offs, name, head + parts, [i + len(head) for i in idxs], types)
            else:
                size = field.parts.end - offs
            self._push_field(field, skip_sum=True)
            offs += size
        return offs

    def _flat_array(self, orig_offs: int, name: str, head: list, offs: int, raw_type: int
                    ) -> _ArrayField | None:
        """The field of an array of strings or scalars at offs; None for any other value."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return None
        raw_itype = self._get(offs, np.uint32)
        alen = self._get(offs + 4, np.uint64)
        itype, count, first = GGUFValueType(raw_itype[0]), int(alen[0]), offs + 12
        scalar = self.gguf_scalar_to_np.get(itype)
        if itype != GGUFValueType.STRING and scalar is None:  # arrays of arrays
            return None
        # Every item takes at least a byte (a string, its 8-byte length): a count beyond what the file
        # holds is corrupt, and walking it would take forever.
        if count * (np.dtype(scalar).itemsize if scalar else 8) > len(self._data) - first:
            raise ValueError(f"an array of {count} items runs past the end of the file")
        parts = _ArrayParts(self._data, [*head, raw_itype, alen], itype, first, count, scalar)
        first_item = len(head) + 2
        step = 2 if itype == GGUFValueType.STRING else 1
        data = list(range(first_item + step - 1, first_item + step * count, step))
        return _ArrayField(orig_offs, name, parts, data, [GGUFValueType.ARRAY, itype])


_LENGTH = struct.Struct("<Q")  # a string's byte count, before its bytes


class _ArrayParts(Sequence):
    """A flat array field's parts, as the stock reader lists them: the key's three, the item type and
    count, then each item's (a string's length and bytes; a scalar), each made when asked for.

    The strings are located when the field is read (the fields after it start where they end): starts[k]
    is the offset of string k's length, starts[count] where the array ends."""

    def __init__(self, data: np.ndarray, head: list[np.ndarray], itype: GGUFValueType, first: int, count: int,
                 scalar: type[np.generic] | None):
        self._data, self._head, self._count = data, head, count
        if itype == GGUFValueType.STRING:
            self.values = None
            self.starts = _string_starts(data, first, count)
            self.end = self.starts[count]
        else:
            self.values = data[first : first + count * np.dtype(scalar).itemsize].view(scalar)
            self.end = first + self.values.nbytes

    def __len__(self) -> int:
        return len(self._head) + self._count * (1 if self.values is not None else 2)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]  # negative indices, and an IndexError past the end
        if index < len(self._head):
            return self._head[index]
        item = index - len(self._head)
        if self.values is not None:
            return self.values[item : item + 1]
        at = self.starts[item // 2]
        if item % 2 == 0:
            return self._data[at : at + 8].view(np.uint64)
        return self._data[at + 8 : self.starts[item // 2 + 1]]

    def items(self, index_or_slice: int | slice) -> Any:
        """Item index_or_slice (an int: one; a slice: a list) as Python values; strings decoded strictly
        from UTF-8 (a UnicodeDecodeError otherwise), as the stock contents() does."""
        if self.values is not None:
            return self.values[index_or_slice].tolist()
        ks = range(self._count)[index_or_slice]
        if isinstance(ks, int):
            return self._string(ks)
        every = self._every_string() if ks == range(self._count) else None
        return every if every is not None else [self._string(k) for k in ks]

    def _string(self, k: int) -> str:
        return bytes(self._data[self.starts[k] + 8 : self.starts[k + 1]]).decode("utf-8")

    def _every_string(self) -> list[str] | None:
        """All the strings, decoded at once: each length becomes a NUL, which UTF-8 text never holds
        but as itself, and the text is split there. None when a string holds a NUL or is not UTF-8 (the
        strings are then decoded one by one, which says which)."""
        base = self.starts[0]
        region = self._data[base : self.starts[-1]].copy()
        at = np.asarray(self.starts[:-1], np.int64) - base
        region[at] = 0
        keep = np.ones(len(region), bool)
        keep[(at[:, None] + np.arange(1, 8)).reshape(-1)] = False
        try:
            strings = region[keep].tobytes().decode("utf-8").split("\0")[1:]
        except UnicodeDecodeError:
            return None
        return strings if len(strings) == self._count else None


def _string_starts(data: np.ndarray, at: int, count: int) -> list[int]:
    """Where each of `count` strings stored from `at` starts (its length), and where the last ends."""
    starts, unpack, size = [0] * (count + 1), _LENGTH.unpack_from, len(data)
    for k in range(count):
        starts[k] = at
        at += 8 + unpack(data, at)[0]  # struct.error when its length is cut off
        if at > size:
            raise ValueError(f"string {k} of an array runs past the end of the file")
    starts[count] = at
    return starts


class _ArrayField(ReaderField):
    """A field holding a flat array, whose contents() reads the items straight from the map."""

    parts: _ArrayParts

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        return self.parts.items(index_or_slice)


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """Open and validate `path`; raise InfernoError naming the problem if it is not a usable GGUF."""
    path = Path(path)
    try:
        os.stat(path)
    except FileNotFoundError:
        raise InfernoError(f"{shown_path(path)}: no such file") from None
    except (OSError, ValueError) as exc:  # a name too long, a loop of symlinks, a NUL in it
        raise InfernoError(f"{shown_path(path)}: cannot read ({getattr(exc, 'strerror', None) or exc})") \
            from None
    if path.is_dir():
        raise InfernoError(f"{path}: is a directory, not a GGUF file")
    special = special_file(path)
    if special is not None:  # opening a FIFO nobody writes to would wait forever; /dev/zero never ends
        raise InfernoError(f"{path}: is {special}, not a GGUF file")
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:  # unreadable: permissions, a FIFO gone away, an I/O error
        raise InfernoError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if size == 0:
        raise InfernoError(f"{path}: file is empty")
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


def metadata(reader: GGUFReader, key: str, default: Any = None, expected: type | None = None) -> Any:
    """The value stored under `key` (a Python scalar, str or list), or `default` when absent.

    expected (int, float, str or bool): the type the value must have; an int is accepted as a float.
    """
    field = reader.get_field(key)
    if field is None:
        return default
    try:
        value = field.contents()
    except UnicodeDecodeError:
        raise InfernoError(f"GGUF metadata {key} holds text that is not valid UTF-8") from None
    if expected is None:
        return value
    accepted = (int, float) if expected is float else expected
    if not isinstance(value, accepted) or (isinstance(value, bool) and expected is not bool):
        raise InfernoError(f"GGUF metadata {key} should be {TYPE_NAMES[expected]}, not {_describe(value)}")
    return expected(value)


TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
_PYTHON_TYPE = {
    **dict.fromkeys((GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                     GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64),
                    int),
    GGUFValueType.FLOAT32: float, GGUFValueType.FLOAT64: float, GGUFValueType.BOOL: bool,
    GGUFValueType.STRING: str,
}


def metadata_list(reader: GGUFReader, key: str, item: type) -> list | None:
    """The array stored under `key`, whose items must be of type `item` (int, float, str or bool);
    None when absent. Checked on the array's declared item type, not item by item."""
    field = reader.get_field(key)
    if field is None:
        return None
    types = list(field.types)
    if types[:1] != [GGUFValueType.ARRAY] or len(types) != 2 or _PYTHON_TYPE.get(types[1]) is not item:
        raise InfernoError(f"GGUF metadata {key} should be a list of {item.__name__}, not "
                           f"{'/'.join(t.name.lower() for t in types)}")
    return metadata(reader, key)


def _describe(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"{type(value).__name__} {value!r}"[:80]


def architecture(reader: GGUFReader) -> str:
    arch = metadata(reader, "general.architecture", expected=str)
    if arch is None:
        raise InfernoError("GGUF metadata has no general.architecture")
    return arch
