"""The prepared-model cache: what every start would otherwise rebuild from a GGUF file (the weights
repacked into tiles, the tokenizer, the config, the fingerprint), written once and memory-mapped by
later starts, so they neither parse the metadata nor copy the weights.

Where: $INFERNO_CACHE_DIR, else $XDG_CACHE_HOME/inferno, else ~/.cache/inferno; one entry per model
content, named by a hash of the file's size and a sample of its bytes (its first and last MiB and 16
pieces between), so copies of one file at several paths share one entry. The directory holds at most
$INFERNO_CACHE_BYTES (default DEFAULT_LIMIT; a number with an optional K, M or G; 0 turns the cache
off): after writing an entry, the least recently used others are deleted until it fits. An entry is
used only when its identity (that sample, the size, this VERSION) matches and every array has the type
and shape the config implies; anything else (stale, cut off, garbled) is rebuilt from the file. An
entry that cannot be written is skipped: the cache only saves time.

An entry: the 16 bytes of MAGIC, the JSON header's offset and length (little-endian uint64s), the
arrays, each at an offset in the file (a multiple of ALIGN) that the header lists with its dtype and
shape, then the header. The header comes last because the weights are written before it is known.
An untied embedding is not copied: the header gives where its blocks lie in the model file (FileRows)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import mmap
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from stat import S_ISREG
from time import perf_counter

import numpy as np
from gguf import GGMLQuantizationType as QType

from inferno.errors import InfernoError
from inferno.file.config import ModelConfig
from inferno.file.reader import open_gguf
from inferno.kernels.file_rows import FileRows
from inferno.kernels.quant import QuantizedMatrix
from inferno.kernels.repack import IN_MEMORY, TileStore
from inferno.kv.snapshot import model_fingerprint
from inferno.model.transformer import Transformer
from inferno.model.validate import check_config, expected_tensors
from inferno.text.tokenizer import GGUFTokenizer

MAGIC = b"INFERNO-PREPARED"
VERSION = 8  # bumped whenever what an entry holds, or the tile layout of quant.py, changes
ALIGN = 64  # bytes: every array starts on a cache line
HEADER_PLACE = len(MAGIC) + 16  # the header's offset and length (little-endian uint64s) follow MAGIC
SAMPLE_BYTES = 1 << 20  # of the model file's start and end, hashed into its identity
CACHE_DIR_ENV = "INFERNO_CACHE_DIR"
LIMIT_ENV = "INFERNO_CACHE_BYTES"
DEFAULT_LIMIT = 8 << 30  # bytes of entries kept: a few models of a few GB
SAMPLE_PIECES = 16  # pieces of SAMPLE_BYTES / 16 between the first and last MiB, hashed too


@dataclass
class Prepared:
    """A model ready for its kernels, and what getting it cost."""

    model: Transformer
    tokenizer: GGUFTokenizer
    fingerprint: str
    cache: str = "off"  # "hit": read from the cache; "miss": built from the file, entry written; "off"
    cache_bytes: int = 0  # the entry's size on disk (0: none)
    parts_ms: dict[str, float] = field(default_factory=dict)  # open, weights, tokenizer, cache_write


def cache_dir() -> Path:
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "inferno"


def cache_limit() -> int:
    """The bytes the cache directory may hold ($INFERNO_CACHE_BYTES); 0: the cache is off."""
    text = os.environ.get(LIMIT_ENV, "").strip()
    if not text:
        return DEFAULT_LIMIT
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    if not number.isdigit():
        raise InfernoError(f"{LIMIT_ENV}={text!r}: expected a number of bytes, optionally with K, M or G")
    return int(number) * scale


def entry_path(model_path: str | os.PathLike) -> Path:
    """The cache entry of the model at `model_path` (whether it exists or not)."""
    return cache_dir() / f"{identity(model_path)['sample_sha256'][:32]}.model"


def identity(model_path: str | os.PathLike) -> dict:
    """What must not have changed for an entry to stand for the file: its size and a sample of its
    content, wherever the file lies."""
    path = Path(os.path.realpath(model_path))  # (Path.resolve raises RuntimeError on a loop of symlinks)
    stat = path.stat()
    if not S_ISREG(stat.st_mode):  # a FIFO or device: read once, by open_gguf
        raise OSError(f"{path} is not a regular file")
    digest = hashlib.sha256(str(stat.st_size).encode())
    piece = SAMPLE_BYTES // SAMPLE_PIECES
    with path.open("rb") as f:
        digest.update(f.read(SAMPLE_BYTES))
        for k in range(1, SAMPLE_PIECES + 1):
            f.seek(stat.st_size * k // (SAMPLE_PIECES + 1))
            digest.update(f.read(piece))
        f.seek(max(SAMPLE_BYTES, stat.st_size - SAMPLE_BYTES))
        digest.update(f.read(SAMPLE_BYTES))
    return {"version": VERSION, "size": stat.st_size, "sample_sha256": digest.hexdigest()}


def load(model_path: str | os.PathLike) -> Prepared:
    """The model at `model_path`, from its cache entry when that is valid, else from the file (and the
    entry then written). Bad model files raise InfernoError as `open_gguf` and the model's checks do."""
    with _no_collections():
        return _load(model_path)


@contextlib.contextmanager
def _no_collections() -> Iterator[None]:
    """Python's cycle collector paused: a load allocates a few hundred thousand objects that live on (the
    GGUF's metadata, the vocabulary) and makes no cycles, and each collection walked them all again
    (a tenth of a first start's load)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _load(model_path: str | os.PathLike) -> Prepared:
    limit = cache_limit()
    try:
        ident = identity(model_path) if limit else None
        entry = cache_dir() / f"{ident['sample_sha256'][:32]}.model" if ident else None
    except OSError:  # no such file, unreadable, no home directory: open_gguf says what is wrong
        entry = ident = None
    if entry is not None:
        try:
            prepared = _read(entry, ident, model_path)
            with contextlib.suppress(OSError):
                os.utime(entry)  # most recently used
            return prepared
        except Exception:  # absent, stale, cut off or garbled: any of it means rebuild
            pass
    writer = _EntryWriter.open(entry) if entry is not None else None
    try:
        prepared, built = _build(model_path, writer or IN_MEMORY)
    except BaseException:
        if writer:
            writer.abandon()
        raise
    if writer is None:
        return prepared
    t = perf_counter()
    written = None  # the model as every later start will find it
    if writer.finish(built, prepared, ident):
        with contextlib.suppress(Exception):  # gone already (another process evicted it), or unreadable
            written = _read(entry, ident, model_path, prepared.tokenizer)
    if written is not None:
        prepared.model, prepared.cache, prepared.cache_bytes = written.model, "miss", written.cache_bytes
        _evict(entry.parent, limit, keep=entry)
    elif writer.deferred:  # some tiles were only in the entry: build them again, in memory
        prepared.model = _build(model_path, IN_MEMORY)[0].model
    prepared.parts_ms["cache_write"] = (perf_counter() - t) * 1000
    return prepared


def _evict(directory: Path, limit: int, keep: Path) -> None:
    """Delete the least recently used entries but `keep` until the directory's entries fit in `limit`
    bytes (`keep` stays even when it alone is larger: it was just asked for), and the half-written
    entries of processes that are gone."""
    entries = []
    for path in directory.glob("*.model"):
        with contextlib.suppress(OSError):
            stat = path.stat()
            entries.append((stat.st_mtime_ns, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        if path != keep:
            with contextlib.suppress(OSError):
                path.unlink()
                total -= size
    for path in directory.glob("*.model.*.tmp"):
        pid = path.name.split(".")[-2]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        pass
    return True


def _build(model_path: str | os.PathLike, store: TileStore) -> tuple[Prepared, dict]:
    """The model from the file, its matrices' tiles built in `store`, and what its weights were built
    into (by tensor name)."""
    t0 = perf_counter()
    reader = open_gguf(model_path)
    config, weights = Transformer.weights_of(reader, store)
    t1 = perf_counter()
    model = Transformer.from_weights(config, weights)
    t2 = perf_counter()
    # Not in the background: building it holds Python's lock, which the repacking loop then waits for
    # (a switch interval per chunk: slower than building it first).
    tokenizer = GGUFTokenizer.from_gguf(reader)
    t3 = perf_counter()
    prepared = Prepared(model, tokenizer, model_fingerprint(reader))
    prepared.parts_ms = {"open": (t1 - t0) * 1000, "weights": (t2 - t1) * 1000, "tokenizer": (t3 - t2) * 1000}
    return prepared, weights.built


class _EntryWriter(TileStore):
    """An entry being written, under a temporary name until `finish` names it, so a reader sees the old
    entry or the new one, never half of one.

    The weights' tiles are written with pwrite, each run of tiles built in a scratch buffer first and
    written by a thread of its own while the next run is built (the copy into new page-cache pages is
    the slow part of a first start), and the model that runs is then read from the finished entry, as
    every later start reads it. Written so, the entry's pages sit in the page cache as large folios,
    which a mapping of the file reaches through 2 MiB page-table entries: decode reads its weights with
    far fewer TLB misses than on the 4 KiB pages that building the tiles in a mapping of the file left
    (docs/LOG.md has the figures). No mapping of the file may be open meanwhile (it slowed the writes
    several times), so while the file is written `empty` hands out placeholders (untouched anonymous
    memory, which costs nothing) that say where each matrix goes."""

    def __init__(self, entry: Path, tmp: Path, fd: int):
        self.entry, self.tmp, self._fd = entry, tmp, fd
        self._end = mmap.PAGESIZE  # the first array's offset: after MAGIC and the header's place
        self._placeholders: list[tuple[int, int, int]] = []  # (address, bytes, offset in the file)
        # Two scratch buffers: one is written to the file (in the writer thread, outside Python's lock)
        # while the next run of tiles is built in the other.
        self._scratch = [np.empty(0, np.uint8), np.empty(0, np.uint8)]
        self._pending: list[Future | None] = [None, None]
        self._turn = 0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="entry-writer")
        self._failed = False  # a write failed: no entry

    @classmethod
    def open(cls, entry: Path) -> _EntryWriter | None:
        """None when the cache directory cannot be written: the cache only saves time."""
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError:
            return None
        return cls(entry, tmp, fd)

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        """A placeholder for tiles of `shape`: where `writing` builds them in the file. The range's blocks
        are reserved first, so a full disk is refused here (the array is then a real one, in memory, and
        `finish` writes it) rather than failing a write later."""
        count = int(np.prod(shape, dtype=np.int64))
        start = _aligned(self._end, ALIGN)
        if count == 0 or self._fd < 0:
            return np.empty(shape, np.uint8)
        try:
            os.posix_fallocate(self._fd, start, count)
            reserved = mmap.mmap(-1, count, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:
            return np.empty(shape, np.uint8)
        array = np.frombuffer(reserved, np.uint8, count).reshape(shape)
        self._placeholders.append((array.ctypes.data, count, start))
        self._end = start + count
        return array

    @property
    def deferred(self) -> bool:
        """True when some tiles exist only in the file (placeholders were handed out)."""
        return bool(self._placeholders)

    @contextlib.contextmanager
    def writing(self, tiles: np.ndarray) -> Iterator[np.ndarray]:
        """A scratch array to build `tiles` in, written to their place in the file afterwards."""
        at = self._place_of(tiles)
        if at is None:  # a real array
            yield tiles
            return
        turn, self._turn = self._turn, 1 - self._turn
        self._settle(turn)  # its last run is in the file
        if self._scratch[turn].size < tiles.nbytes:
            self._scratch[turn] = np.empty(tiles.nbytes, np.uint8)
        scratch = self._scratch[turn][: tiles.nbytes].reshape(tiles.shape)
        yield scratch
        if not self._failed:
            self._pending[turn] = self._writer.submit(self._write, scratch.reshape(-1), at)

    def _settle(self, turn: int) -> None:
        """Wait for the write from scratch buffer `turn`; a failed one (an I/O error) means no entry, and
        `load` then builds the model in memory."""
        pending, self._pending[turn] = self._pending[turn], None
        if pending is not None:
            try:
                pending.result()
            except OSError:
                self._failed = True

    def _place_of(self, array: np.ndarray) -> int | None:
        """Where `array` (a placeholder or part of one) lies in the file; None: not a placeholder."""
        address = array.ctypes.data
        for base, size, offset in self._placeholders:
            if base <= address < base + size:
                return offset + address - base
        return None

    def finish(self, built: dict, prepared: Prepared, ident: dict) -> bool:
        """Write what is not in the file yet (vectors, the tokenizer) and the header, and name the
        entry. False (and no entry) when that fails."""
        for turn in (0, 1):
            self._settle(turn)
        self._writer.shutdown()
        if self._failed:
            self.abandon()
            return False
        arrays, matrices, in_file = {}, {}, {}
        for name, item in built.items():
            if isinstance(item, FileRows):  # later starts read it from the model file too (load maps one)
                in_file[name] = {"qtype": int(item.qtype), "rows": item.rows, "cols": item.cols,
                                 "offset": item.offset}
            elif isinstance(item, QuantizedMatrix):
                arrays[name] = item.tiles
                matrices[name] = {"names": item.part_names, "qtype": int(item.qtype), "cols": item.cols,
                                  "parts": item.parts}
            else:
                arrays[name] = item
        state, tokenizer_json = prepared.tokenizer.to_state()
        arrays["tokenizer/state"] = np.frombuffer(json.dumps(state).encode(), np.uint8)
        arrays["tokenizer/json"] = np.frombuffer(tokenizer_json.encode(), np.uint8)
        try:
            specs = {name: {"dtype": a.dtype.str, "shape": list(a.shape), "offset": self._place(a)}
                     for name, a in arrays.items()}
            header = json.dumps({"identity": ident, "config": asdict(prepared.model.config),
                                 "fingerprint": prepared.fingerprint, "matrices": matrices,
                                 "in_file": in_file, "arrays": specs}).encode()
            at = _aligned(self._end)
            self._write(header, at)
            self._write(MAGIC + np.array([at, len(header)], "<u8").tobytes(), 0)
            os.close(self._fd)
            self._fd = -1
            os.replace(self.tmp, self.entry)
            return True
        except OSError:
            self.abandon()
            return False

    def abandon(self) -> None:
        """Delete the half-written entry."""
        self._writer.shutdown(cancel_futures=True)
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(OSError):
            self.tmp.unlink()

    def _place(self, array: np.ndarray) -> int:
        """The array's offset in the file, writing it there if `empty` did not put it there."""
        placed = self._place_of(array)
        if placed is not None:
            return placed
        at = _aligned(self._end)
        self._write(np.ascontiguousarray(array).reshape(-1).view(np.uint8), at)
        self._end = at + array.nbytes
        return at

    def _write(self, data: bytes | np.ndarray, at: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self._fd, view, at)
            view, at = view[n:], at + n


def _aligned(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _read(entry: Path, ident: dict, model_path: str | os.PathLike, tokenizer: GGUFTokenizer | None = None
          ) -> Prepared:
    """The model from a valid entry (with `tokenizer`, when given, instead of the entry's); any exception
    means the entry cannot be used."""
    t0 = perf_counter()
    with entry.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable arrays, file untouched
    size = len(mapped)
    if mapped[: len(MAGIC)] != MAGIC:
        raise ValueError("not a prepared-model entry")
    at, length = (int(n) for n in np.frombuffer(mapped, "<u8", 2, len(MAGIC)))
    header = json.loads(mapped[at : at + length])
    if header["identity"] != ident:
        raise ValueError("stale entry")

    def array(name: str) -> np.ndarray:
        spec = header["arrays"][name]
        dtype, shape, offset = np.dtype(spec["dtype"]), tuple(map(int, spec["shape"])), int(spec["offset"])
        count = int(np.prod(shape, dtype=np.int64))
        end = offset + count * dtype.itemsize
        if offset % ALIGN or offset < HEADER_PLACE or min(shape, default=1) < 0 or end > at:
            raise ValueError(f"array {name} lies outside the entry's arrays")
        return np.frombuffer(mapped, dtype, count, offset).reshape(shape)

    fields = header["config"]
    per_layer = ("layer_windows", "layer_rope_bases")  # tuples, which JSON wrote as lists
    config = ModelConfig(**fields | {key: tuple(fields[key]) for key in per_layer})
    check_config(config)
    t1 = perf_counter()
    weights = _CachedWeights(config, header["matrices"], set(header["arrays"]), array, header["in_file"],
                             str(model_path))
    model = Transformer.from_weights(config, weights)
    _map_now(mapped, [m.tiles for m in (*model.layer_matrices(), model.output)])
    t2 = perf_counter()
    # `tokenizers` builds a large vocabulary for hundreds of milliseconds holding Python's lock, so
    # building it in a thread beside the kernels' loading only moved the wait.
    try:
        tokenizer = tokenizer or GGUFTokenizer.from_state(json.loads(array("tokenizer/state").tobytes()),
                                                          array("tokenizer/json").tobytes().decode())
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError("more tokens than embedding rows")
    except Exception:  # a garbled tokenizer in a good entry: the model file still has it
        tokenizer = GGUFTokenizer.from_gguf(open_gguf(model_path))
    t3 = perf_counter()
    parts = {"open": (t1 - t0) * 1000, "weights": (t2 - t1) * 1000, "tokenizer": (t3 - t2) * 1000}
    return Prepared(model, tokenizer, str(header["fingerprint"]), "hit", size, parts)


# Linux's madvise(MADV_POPULATE_READ), 5.14 on: maps a range's pages in one call, several times faster
# than the first forward's faults, one each 16 pages.
POPULATE_READ = 22


def _map_now(mapped: mmap.mmap, arrays: list[np.ndarray]) -> None:
    """Map the pages of `arrays` (views of `mapped`: the weights every forward reads in full) now, not
    in the first forward. The embedding's, of which a forward reads a few rows, stay unmapped."""
    if sys.platform != "linux":
        return
    base = np.frombuffer(mapped, np.uint8).ctypes.data
    for array in arrays:
        start = array.ctypes.data - base
        first = start - start % mmap.PAGESIZE
        try:
            mapped.madvise(POPULATE_READ, first, start + array.nbytes - first)
        except OSError:  # an older kernel: the first forward faults them in, as before
            return


class _CachedWeights:
    """The weights of an entry, each checked against the shape the config gives its name: a wrong
    entry raises (and is rebuilt) rather than handing a kernel arrays it would index out of bounds."""

    def __init__(self, config: ModelConfig, matrices: dict, arrays: set[str],
                 array: Callable[[str], np.ndarray], in_file: dict, model_path: str):
        self._matrices, self._array, self._in_file, self._model_path = matrices, array, in_file, model_path
        self._stack_of = {part: key for key, spec in matrices.items() for part in spec["names"]}
        self._present = set(self._stack_of) | arrays | set(in_file)
        expected = expected_tensors(config, self._present)
        self._shapes = {name: shape(config) for name, shape in expected.items()}
        self._hidden = config.hidden_size

    def has(self, name: str) -> bool:
        return name in self._present

    def vector(self, name: str) -> np.ndarray:
        vector = self._array(name)
        if vector.dtype != np.float32 or vector.shape != self._shapes.get(name, (self._hidden,)):
            raise ValueError(f"{name}: {vector.dtype} {vector.shape}")
        return vector

    def stacked(self, names: list[str]) -> list[QuantizedMatrix]:
        keys = list(dict.fromkeys(self._stack_of[name] for name in names))
        matrices = []
        for key in keys:
            spec = self._matrices[key]
            parts = [tuple(int(n) for n in part) for part in spec["parts"]]
            for name, (_, rows) in zip(spec["names"], parts, strict=True):
                if name not in names or self._shapes[name] != (rows, int(spec["cols"])):
                    raise ValueError(f"{name}: not a weight of {rows} x {spec['cols']} here")
            matrices.append(QuantizedMatrix.from_tiles(spec["names"], QType(spec["qtype"]), int(spec["cols"]),
                                                       self._array(key), parts))
        return matrices

    def rows(self, name: str) -> FileRows:
        spec = self._in_file[name]
        rows, cols = int(spec["rows"]), int(spec["cols"])
        if self._shapes[name] != (rows, cols):
            raise ValueError(f"{name}: not a weight of {rows} x {cols} here")
        return FileRows.mapped(self._model_path, name, QType(spec["qtype"]), rows, cols, int(spec["offset"]))
