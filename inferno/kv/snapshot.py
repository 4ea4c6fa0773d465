"""Cache snapshots: a KV cache's committed rows and their token ids in one safetensors file.

A long prompt's prefill is paid once: save the cache after a run, load it into any cache layout of the
same model, and only the tokens past the snapshot's are prefilled. The file is what mlx-lm uses for
prompt caches: safetensors, with the description in the JSON header's `__metadata__` (strings only).

    keys       float32 [layers, length, kv_width]   K after RoPE, kv_width = kv_heads * head_dim
    values     float32 [layers, length, kv_width]
    token_ids  int32   [length]                     the token whose K and V each position holds
    __metadata__: format, version, architecture, layers, kv_heads, heads, head_dim,
                  fingerprint (sha256 of the model), data_sha256 (sha256 of the three tensors),
                  kv_dtype (the element type of the rows; absent means f32)

A cache of another element type is saved as it stores its rows: keys and values are then uint8
[layers, length, row_bytes] (q8_0: llama.cpp's blocks), so nothing is rounded twice. Loading into a
cache of the same element type copies the rows; into another, they are decoded to float32 and the
cache encodes them as it encodes any row.

The fingerprint is the sha256 of, in order: the JSON (Python's json.dumps) of
`[architecture, {"layers": L, "kv_heads": KV, "heads": H, "head_dim": D}]`; then for each tensor, in
the file's order, the line `"\n{name} {shape} {type}\n"` (shape as the GGUF header lists it, e.g.
`[576, 49152]`, type the GGML type name, e.g. `Q8_0`) followed by the first 64 bytes of its data.

Cached keys already carry their position's rotation, so rows are only valid at the positions they
were computed for: a snapshot is reused as a prefix, never shifted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from inferno.arguments import shown_path
from inferno.errors import InfernoError
from inferno.file.config import ModelConfig
from inferno.kv import KVCache, KVGeometry
from inferno.kv.dtypes import F32, element_type

FORMAT = "inferno-kv-snapshot"
VERSION = 1
TENSORS = ("keys", "values", "token_ids")
SAMPLE_BYTES = 64  # of each tensor's data in the fingerprint


GEOMETRY_KEYS = ("layers", "kv_heads", "heads", "head_dim")  # the shape; a model's windows go in `windows`


def model_fingerprint(reader: GGUFReader) -> str:
    """sha256 of what decides a cache's numbers: architecture, geometry and every tensor's name,
    shape and type, plus the first bytes of its data.

    Metadata alone cannot tell two fine-tunes of one base apart (SmolLM2-135M and its -Instruct
    share every name, shape and type); a few bytes per tensor can, without reading the weights.
    """
    config = ModelConfig.from_gguf(reader)
    digest = hashlib.sha256()
    shape = {name: getattr(config.kv_geometry, name) for name in GEOMETRY_KEYS}
    digest.update(json.dumps([config.architecture, shape]).encode())
    for tensor in reader.tensors:
        shape = [int(n) for n in tensor.shape]
        digest.update(f"\n{tensor.name} {shape} {tensor.tensor_type.name}\n".encode())
        digest.update(tensor.data.reshape(-1).view(np.uint8)[:SAMPLE_BYTES].tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Snapshot:
    keys: np.ndarray  # [layers, length, row]: float32 kv_width values, or the dtype's encoded row
    values: np.ndarray
    token_ids: np.ndarray  # int32 [length]
    architecture: str
    geometry: KVGeometry
    fingerprint: str
    dtype: str = F32

    def float_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values as float32 [layers, length, kv_width], decoded from their element type."""
        t, g = element_type(self.dtype), self.geometry
        return tuple(np.stack([t.decode(rows, g) for rows in stored]) for stored in (self.keys, self.values))

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values."""
        return self.keys.nbytes + self.values.nbytes

    @classmethod
    def from_cache(
        cls, cache: KVCache, token_ids: Sequence[int], config: ModelConfig, fingerprint: str
    ) -> Snapshot:
        """The cache's committed rows, read through the cache protocol so every layout works.

        token_ids may run past the committed length: the last token a run samples is never fed back.
        """
        if cache.length == 0:
            raise InfernoError("the KV cache is empty: there is nothing to save")
        if len(token_ids) < cache.length:
            raise ValueError(f"{len(token_ids)} token ids for a cache of {cache.length} tokens")
        rows = [cache.stored_rows(layer) for layer in range(cache.n_layers)]
        return cls(
            keys=np.stack([k for k, _ in rows]),
            values=np.stack([v for _, v in rows]),
            token_ids=np.asarray(token_ids[: cache.length], dtype=np.int32),
            architecture=config.architecture,
            geometry=config.kv_geometry,
            fingerprint=fingerprint,
            dtype=cache.dtype.name,
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write to a temporary file beside `path`, then rename: a failed (or interrupted: Ctrl-C,
        SIGTERM) save leaves no half file, and nothing but `path`, a regular file, is ever replaced."""
        path = Path(path)
        check_save_path(path)
        tensors = {"keys": self.keys, "values": self.values, "token_ids": self.token_ids}
        metadata = {
            "format": FORMAT,
            "version": str(VERSION),
            "architecture": self.architecture,
            **{name: str(getattr(self.geometry, name)) for name in GEOMETRY_KEYS},
            **({"windows": _windows_text(self.geometry.windows)} if self.geometry.windows else {}),
            "fingerprint": self.fingerprint,
            "data_sha256": _data_sha256(tensors),
            "kv_dtype": self.dtype,
        }
        data = save(tensors, metadata=metadata)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        created = False
        try:
            # O_EXCL: a name planted beside the file (a symlink, a FIFO) is never followed or opened
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
            created = True
            try:
                _write(fd, data)
            finally:
                os.close(fd)
            check_save_path(path)  # what is at the path now, just before it is replaced
            os.replace(tmp, path)
        except BaseException as exc:  # a full disk, a read-only directory, Ctrl-C, SIGTERM: no temp file left
            if created:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
            if not isinstance(exc, OSError):
                raise
            raise InfernoError(f"cannot save the KV cache to {path}: {exc.strerror or exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike, model: tuple[ModelConfig, str] | None = None) -> Snapshot:
        """Read and check a snapshot file; anything wrong with it is one InfernoError.

        Its header (metadata, tensor shapes) is checked, then its checksum, reading the file a piece
        at a time, and only then are the rows read into memory: a file declaring gigabytes it does not
        hold (a sparse file, a wrong checksum) is refused without them. `model` (config, fingerprint):
        the model the snapshot must be of, also checked before the rows are read."""
        path = Path(path)
        if not os.path.isfile(path):  # (os.path: a name too long is no file, not an OSError)
            shown = shown_path(path)
            raise InfernoError(f"{shown}: not a file" if os.path.lexists(path) else f"{shown}: no such file")
        try:
            with safe_open(path, framework="numpy") as f:
                meta = f.metadata() or {}
                shapes = {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                          for name in TENSORS}
                cls._check_header(path, meta, shapes, model)
                _check_file_sha256(path, meta.get("data_sha256"))
                tensors = {name: f.get_tensor(name) for name in TENSORS}
        except (SafetensorError, OSError, ValueError) as exc:
            raise InfernoError(f"{path}: truncated or corrupt KV cache snapshot ({exc})") from None
        if meta.get("format") != FORMAT:
            raise InfernoError(f"{path}: not a KV cache snapshot (no format {FORMAT!r} in its header)")
        if meta.get("version") != str(VERSION):
            raise InfernoError(
                f"{path}: snapshot format version {meta.get('version')}, this inferno reads version {VERSION}"
            )
        try:
            windows = _windows_from_text(meta.get("windows", ""))
            geometry = KVGeometry(**{name: int(meta[name]) for name in GEOMETRY_KEYS}, windows=windows)
            architecture, fingerprint = meta["architecture"], meta["fingerprint"]
            checksum = meta["data_sha256"]
            dtype = meta.get("kv_dtype", F32)
            stored = element_type(dtype)
            row_items = stored.row_items(geometry)
        except (KeyError, ValueError, InfernoError) as exc:
            raise InfernoError(f"{path}: corrupt KV cache snapshot (missing or bad {exc})") from None
        keys, values, token_ids = (tensors[name] for name in TENSORS)
        length = token_ids.shape[0] if token_ids.ndim == 1 else -1
        expected = (geometry.layers, length, row_items)
        if (
            length < 1
            or token_ids.dtype != np.int32
            or keys.dtype != stored.storage
            or values.dtype != stored.storage
            or keys.shape != expected
            or values.shape != expected
        ):
            raise InfernoError(
                f"{path}: corrupt KV cache snapshot (tensors keys {keys.shape}, values {values.shape}, "
                f"token_ids {token_ids.shape} do not fit its {geometry})"
            )
        if _data_sha256(tensors) != checksum:
            raise InfernoError(f"{path}: corrupt KV cache snapshot (its data does not match its checksum)")
        snapshot = cls(keys, values, token_ids, architecture, geometry, fingerprint, dtype)
        snapshot.check_finite(path)
        return snapshot

    @classmethod
    def _check_header(
        cls, path: Path, meta: dict, shapes: dict, model: tuple[ModelConfig, str] | None
    ) -> None:
        """What the header says, before any row is read: the format, a geometry, shapes that fit it and
        bytes this machine could hold; and the model, when one is given."""
        if meta.get("format") != FORMAT:
            raise InfernoError(f"{path}: not a KV cache snapshot (no format {FORMAT!r} in its header)")
        try:
            windows = _windows_from_text(meta.get("windows", ""))
            geometry = KVGeometry(**{name: int(meta[name]) for name in GEOMETRY_KEYS}, windows=windows)
            stored = element_type(meta.get("kv_dtype", F32))
            row_items = stored.row_items(geometry)
        except (KeyError, ValueError, InfernoError) as exc:
            raise InfernoError(f"{path}: corrupt KV cache snapshot (missing or bad {exc})") from None
        ids = shapes["token_ids"][0]
        length = ids[0] if len(ids) == 1 else -1
        expected = (geometry.layers, length, row_items)
        if length < 1 or shapes["keys"][0] != expected or shapes["values"][0] != expected:
            raise InfernoError(
                f"{path}: corrupt KV cache snapshot (tensors keys {shapes['keys'][0]}, values "
                f"{shapes['values'][0]}, token_ids {ids} do not fit its {geometry})"
            )
        rows = 2 * math.prod(expected) * np.dtype(stored.storage).itemsize
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            total = None
        if total is not None and rows > total:
            raise InfernoError(f"{path}: a KV cache snapshot of {rows / 2**30:,.1f} GiB is more than this "
                               f"machine's {total / 2**30:,.1f} GiB of memory")
        on_disk = path.stat().st_blocks * 512
        if rows > 64 * 2**20 and on_disk < rows // 4:  # a sparse file: reading its "rows" reads zeros
            raise InfernoError(f"{path}: corrupt KV cache snapshot (its header declares "
                               f"{rows / 2**30:,.1f} GiB of rows, the file holds {on_disk / 2**30:,.1f} GiB)")
        if model is not None:
            config, fingerprint = model
            for key in ("architecture", "fingerprint"):
                if not isinstance(meta.get(key), str):
                    raise InfernoError(f"{path}: corrupt KV cache snapshot (missing or bad '{key}')")
            if length > config.context_length:
                raise InfernoError(f"{path}: the snapshot holds {length:,} tokens, more than the model's "
                                   f"context of {config.context_length:,}")
            header_only = cls(np.empty(0), np.empty(0), np.empty(0), meta.get("architecture"), geometry,
                              meta.get("fingerprint"))
            header_only.check_model(config, fingerprint)

    def check_finite(self, path: str | os.PathLike = "snapshot") -> None:
        """Refuse rows holding NaN or infinity (a block's scale included): no model computes them, and
        nothing downstream (norms, attention, a restored run) can make sense of them."""
        t, g = element_type(self.dtype), self.geometry
        for name, stored in (("keys", self.keys), ("values", self.values)):
            for layer, rows in enumerate(stored):
                decoded = rows if self.dtype == F32 else t.decode(rows, g)
                bad = ~np.isfinite(decoded)
                if bad.any():
                    position = int(np.argwhere(bad)[0][0])
                    raise InfernoError(
                        f"{path}: corrupt KV cache snapshot ({name} of layer {layer} at position {position} "
                        "hold NaN or infinity)"
                    )

    def check_model(self, config: ModelConfig, fingerprint: str) -> None:
        """Refuse a model other than the one the snapshot was made with."""
        arch, geometry = config.architecture, config.kv_geometry
        if (self.architecture, self.geometry) != (arch, geometry):
            raise InfernoError(
                f"the snapshot is from another model ({self.architecture}, {self.geometry}), "
                f"not this one ({arch}, {geometry})"
            )
        if self.fingerprint != fingerprint:
            raise InfernoError(
                f"the snapshot is from another model: same shape, different weights "
                f"(fingerprint {self.fingerprint[:12]}, this model's {fingerprint[:12]})"
            )

    def restore(self, cache: KVCache, prompt_ids: Sequence[int]) -> int:
        """Put the rows of the prompt's prefix into an empty cache; returns how many tokens it now holds.

        The prompt must begin with all the snapshot's tokens. When it is exactly those tokens, the
        last one is left out: generating needs one forward for its logits. Rows go in as stored when
        the cache's element type is the snapshot's, else decoded and encoded again by the cache.
        """
        if cache.length:
            raise ValueError(f"restore into a cache that already holds {cache.length} tokens")
        ours = self.token_ids.tolist()
        differ = next((i for i, (a, b) in enumerate(zip(prompt_ids, ours, strict=False)) if a != b), None)
        if differ is not None:
            raise InfernoError(
                f"the prompt does not begin with the snapshot's {self.length} tokens: at position {differ} "
                f"it has token {prompt_ids[differ]}, the snapshot {ours[differ]}"
            )
        if len(prompt_ids) < self.length:
            raise InfernoError(
                f"the prompt ({len(prompt_ids)} tokens) is shorter than the snapshot's {self.length} tokens; "
                "it must begin with all of them (a snapshot saved after generating holds the new tokens too)"
            )
        n = min(self.length, len(prompt_ids) - 1)
        same = cache.dtype.name == self.dtype
        keys, values = (self.keys, self.values) if same else self.float_rows()
        write = cache.write_stored if same else cache.write
        for layer in range(cache.n_layers):
            write(layer, 0, keys[layer, :n], values[layer, :n])
        cache.commit(n)
        return n


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def check_save_path(path: str | os.PathLike) -> None:
    """Refuse, before any work, a snapshot path that is not a regular file or absent: a symlink (never
    followed), a directory, a FIFO, a device or a socket; and a directory that does not exist."""
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise InfernoError(f"cannot save the KV cache to {shown_path(path)}: {exc.strerror or exc}") from None
    if info is not None:
        if stat.S_ISLNK(info.st_mode):
            raise InfernoError(
                f"cannot save the KV cache to {path}: it is a symbolic link, which is never followed or "
                "replaced: name a regular file"
            )
        if not stat.S_ISREG(info.st_mode):
            raise InfernoError(
                f"cannot save the KV cache to {path}: it is {_file_kind(info.st_mode)}, not a regular file"
            )
    parent = path.parent
    if not os.path.isdir(parent):
        raise InfernoError(f"cannot save the KV cache to {path}: no directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InfernoError(f"cannot save the KV cache to {path}: directory {parent} is not writable")


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _windows_text(windows: tuple[int | None, ...]) -> str:
    return ",".join("global" if w is None else str(w) for w in windows)


def _windows_from_text(text: str) -> tuple[int | None, ...]:
    return tuple(None if w == "global" else int(w) for w in text.split(",")) if text else ()


def _check_file_sha256(path: Path, checksum: str | None) -> None:
    """The data's sha256 (what _data_sha256 computes of the tensors) read from the file 1 MiB at a
    time: the tensors are stored in TENSORS order right after the header."""
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        start = f.tell()
        digest = hashlib.sha256()
        for name in TENSORS:
            begin, end = header[name]["data_offsets"]
            f.seek(start + begin)
            left = end - begin
            while left > 0:
                piece = f.read(min(left, 1 << 20))
                if not piece:
                    raise InfernoError(f"{path}: truncated KV cache snapshot")
                digest.update(piece)
                left -= len(piece)
    if digest.hexdigest() != checksum:
        raise InfernoError(f"{path}: corrupt KV cache snapshot (its data does not match its checksum)")


def _data_sha256(tensors: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in TENSORS:
        digest.update(np.ascontiguousarray(tensors[name]).data)
    return digest.hexdigest()
