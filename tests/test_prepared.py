"""The prepared-model cache: reused by a second load, rebuilt when the model file changes or the entry
is stale, cut off or garbled, skipped when it cannot be written; the model it gives computes exactly
what the model built from the file computes."""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, greedy

from inferno.errors import InfernoError
from inferno.kernels.file_rows import FileRows
from inferno.kv import make_cache
from inferno.model import prepared

TINY = FIXTURES / "tiny_qwen2.gguf"  # biases as well as norms and stacked matrices


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv(prepared.CACHE_DIR_ENV, str(directory))
    return directory


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copyfile(TINY, path)
    return path


def logits_of(ready: prepared.Prepared, ids: list[int]) -> np.ndarray:
    """Every logit of a prefill then three decode steps."""
    model = ready.model
    cache = make_cache("prealloc", model.config.kv_geometry, len(ids) + 3)
    out = [model.prefill(np.array(ids), cache)]
    for token in (5, 6, 7):
        out.append(model.decode(token, cache.length, cache))
    return np.stack(out)


def same_model(a: prepared.Prepared, b: prepared.Prepared) -> None:
    text = "hello world, the cache"
    assert a.tokenizer.encode(text) == b.tokenizer.encode(text)
    assert [a.tokenizer.token_bytes(i) for i in range(a.tokenizer.vocab_size)] == [
        b.tokenizer.token_bytes(i) for i in range(b.tokenizer.vocab_size)]
    assert a.tokenizer.is_stop(a.tokenizer.eos_id) and b.tokenizer.is_stop(b.tokenizer.eos_id)
    assert a.fingerprint == b.fingerprint and a.model.config == b.model.config
    ids = a.tokenizer.encode(text)
    np.testing.assert_array_equal(logits_of(a, ids), logits_of(b, ids))  # bit for bit


def test_a_second_load_reads_the_entry_and_computes_the_same(cache_dir, model_file):
    built = prepared.load(model_file)
    assert built.cache == "miss" and prepared.entry_path(model_file).is_file()
    cached = prepared.load(model_file)
    assert cached.cache == "hit"
    assert set(cached.parts_ms) == {"open", "weights", "tokenizer"}
    same_model(built, cached)


def replace(entry, data: bytes) -> None:
    """The entry replaced by `data`, as a new file: the process that wrote the entry maps it (its
    weights were built in the file), and a file cut short under a mapping faults (SIGBUS) on its lost
    pages, as any memory-mapped model file does."""
    tmp = entry.with_suffix(".new")
    tmp.write_bytes(data)
    os.replace(tmp, entry)


def test_a_garbled_tokenizer_in_an_entry_is_built_from_the_file(cache_dir, model_file):
    built = prepared.load(model_file)
    entry = prepared.entry_path(model_file)
    data = bytearray(entry.read_bytes())
    header_at = int(np.frombuffer(data, "<u8", 1, len(prepared.MAGIC))[0])
    at = data.rfind(b'"model"', 0, header_at)  # inside the tokenizers JSON, the last array
    data[at : at + 7] = b"{{{{{{{"
    replace(entry, bytes(data))
    cached = prepared.load(model_file)
    assert cached.cache == "hit"  # its weights are good; its tokenizer came from the model file
    text = "The tokenizer, rebuilt: 12 + 30 = 42."
    assert cached.tokenizer.encode(text) == built.tokenizer.encode(text)


def test_a_changed_model_file_is_rebuilt(cache_dir, model_file):
    prepared.load(model_file)
    stat = model_file.stat()
    os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: the same content
    assert prepared.load(model_file).cache == "hit"
    # the same size and mtime, other content: the content sample tells them apart
    data = bytearray(model_file.read_bytes())
    stat = model_file.stat()
    data[-1] ^= 0xFF
    model_file.write_bytes(bytes(data))
    os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert prepared.load(model_file).cache == "miss"
    assert prepared.load(model_file).cache == "hit"


def test_copies_of_one_file_share_one_entry(cache_dir, model_file, tmp_path):
    copy = tmp_path / "elsewhere" / "copy.gguf"
    copy.parent.mkdir()
    shutil.copyfile(model_file, copy)
    first = prepared.load(model_file)
    assert first.cache == "miss" and first.cache_bytes == prepared.entry_path(model_file).stat().st_size
    second = prepared.load(copy)
    assert second.cache == "hit" and second.cache_bytes == first.cache_bytes
    assert len(list(cache_dir.glob("*.model"))) == 1


def test_the_least_recently_used_entries_go_when_the_cache_is_full(cache_dir, model_file, tmp_path,
                                                                   monkeypatch):
    others = []
    for k in range(3):  # three models of other content
        path = tmp_path / f"other{k}.gguf"
        data = bytearray(model_file.read_bytes())
        data[-1 - k] ^= 0xFF
        path.write_bytes(bytes(data))
        others.append(path)
    size = prepared.load(model_file).cache_bytes
    monkeypatch.setenv(prepared.LIMIT_ENV, str(2 * size + size // 2))  # room for two entries
    prepared.load(others[0])
    assert prepared.load(model_file).cache == "hit"  # used again: now the most recent
    prepared.load(others[1])  # a third entry: the least recently used (others[0]) goes
    assert not prepared.entry_path(others[0]).exists()
    assert prepared.entry_path(model_file).exists() and prepared.entry_path(others[1]).exists()
    monkeypatch.setenv(prepared.LIMIT_ENV, "1K")  # smaller than any entry: the new one alone stays
    prepared.load(others[2])
    assert [p.name for p in cache_dir.glob("*.model")] == [prepared.entry_path(others[2]).name]


def test_a_cache_limit_of_zero_turns_it_off_and_a_bad_one_is_one_error(cache_dir, model_file, monkeypatch):
    monkeypatch.setenv(prepared.LIMIT_ENV, "0")
    ready = prepared.load(model_file)
    assert (ready.cache, ready.cache_bytes) == ("off", 0) and not cache_dir.exists()
    monkeypatch.setenv(prepared.LIMIT_ENV, "lots")
    with pytest.raises(InfernoError, match="INFERNO_CACHE_BYTES='lots'"):
        prepared.load(model_file)


def rewrite_header(entry, change) -> None:
    """Apply change(header) to an entry's JSON header, keeping its arrays where they are."""
    raw = entry.read_bytes()
    at, length = (int(n) for n in np.frombuffer(raw, "<u8", 2, len(prepared.MAGIC)))
    header = json.loads(raw[at : at + length])
    change(header)
    new = json.dumps(header).encode()
    start = prepared.MAGIC + np.array([at, len(new)], "<u8").tobytes()
    replace(entry, start + raw[prepared.HEADER_PLACE : at] + new)


def garble_header(entry) -> None:
    raw = entry.read_bytes()
    at = int(np.frombuffer(raw, "<u8", 1, len(prepared.MAGIC))[0]) + 10
    replace(entry, raw[:at] + b"garbage" + raw[at + 7 :])


def shrink_a_matrix(header: dict) -> None:
    """A stacked matrix that claims fewer rows (tiles and parts consistent with each other)."""
    key = next(k for k, spec in header["matrices"].items() if len(spec["names"]) == 1)
    header["matrices"][key]["parts"] = [[0, 1]]
    header["arrays"][key]["shape"][0] = 1


def shrink_a_vector(header: dict) -> None:
    key = next(k for k in header["arrays"] if k.endswith("attn_norm.weight"))
    header["arrays"][key]["shape"] = [1]


@pytest.mark.parametrize("damage", [
    lambda entry: replace(entry, entry.read_bytes()[: entry.stat().st_size // 2]),  # cut off
    lambda entry: replace(entry, b"\0" * 64),  # not an entry at all
    lambda entry: garble_header(entry),
    lambda entry: rewrite_header(entry, lambda h: h["identity"].update(version=0)),  # an older format
    lambda entry: rewrite_header(entry, shrink_a_matrix),
    lambda entry: rewrite_header(entry, shrink_a_vector),
    lambda entry: rewrite_header(entry, lambda h: h["config"].update(hidden_size=0)),
], ids=["cut-off", "zeros", "garbled-header", "old-version", "matrix-shape", "vector-shape", "config"])
def test_a_bad_entry_is_rebuilt_never_used(cache_dir, model_file, damage):
    built = prepared.load(model_file)
    damage(prepared.entry_path(model_file))
    rebuilt = prepared.load(model_file)
    assert rebuilt.cache == "miss"
    same_model(built, rebuilt)
    assert prepared.load(model_file).cache == "hit"  # the rebuilt entry is good


def test_an_untied_embedding_is_read_from_the_model_file_not_copied(cache_dir, tmp_path):
    path = tmp_path / "untied.gguf"
    shutil.copyfile(FIXTURES / "tiny_qwen3.gguf", path)  # an output matrix of its own
    built = prepared.load(path)
    raw = prepared.entry_path(path).read_bytes()
    at, length = (int(n) for n in np.frombuffer(raw, "<u8", 2, len(prepared.MAGIC)))
    header = json.loads(raw[at : at + length])
    assert set(header["in_file"]) == {"token_embd.weight"} and "token_embd.weight" not in header["arrays"]
    assert all("token_embd.weight" not in spec["names"] for spec in header["matrices"].values())
    hit = prepared.load(path)
    assert hit.cache == "hit" and isinstance(hit.model.embedding, FileRows)
    same_model(built, hit)
    rewrite_header(prepared.entry_path(path), lambda h: h["in_file"]["token_embd.weight"].update(
        offset=path.stat().st_size - 8))  # past the end of the model file: rebuilt
    rebuilt = prepared.load(path)
    assert rebuilt.cache == "miss"
    same_model(built, rebuilt)


def test_an_unwritable_cache_is_skipped(tmp_path, monkeypatch, model_file):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(prepared.CACHE_DIR_ENV, str(blocker / "cache"))  # under a file: mkdir fails
    ready = prepared.load(model_file)
    assert ready.cache == "off" and not list(tmp_path.glob("**/*.model"))
    assert ready.tokenizer.encode("hello") == prepared.load(model_file).tokenizer.encode("hello")


def in_a_mapping(array: np.ndarray) -> bool:
    while isinstance(array, np.ndarray):
        array = array.base
    return isinstance(getattr(array, "obj", array), mmap.mmap)


def mapped_from(array: np.ndarray, path: Path) -> bool:
    """Whether `array` lies in a mapping of the file at `path` (Linux's /proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *_, name = line.split(maxsplit=5)
        low, high = (int(n, 16) for n in span.split("-"))
        if low <= array.ctypes.data < high:
            return name.strip() == str(path)
    return False


def test_a_first_load_runs_on_the_entry_it_wrote(cache_dir, model_file):
    """The tiles are written to the entry, and the model runs on its pages as a later load's does."""
    built = prepared.load(model_file)
    assert built.cache == "miss"
    tiles = [m.tiles for m in built.model.layer_matrices()]
    assert all(mapped_from(t, prepared.entry_path(model_file)) for t in tiles)
    same_model(built, prepared.load(model_file))


def test_a_full_disk_is_no_crash(cache_dir, model_file, monkeypatch):
    """No block can be reserved (the tiles are then built in memory) and no write succeeds: no entry,
    the model all the same."""
    reference = prepared.load(model_file)
    prepared.entry_path(model_file).unlink()
    fallocate, pwrite = os.posix_fallocate, os.pwrite

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(os, "pwrite", full)
    rebuilt = prepared.load(model_file)
    assert rebuilt.cache == "off" and not prepared.entry_path(model_file).exists()
    assert not any(in_a_mapping(m.tiles) for m in rebuilt.model.layer_matrices())
    same_model(reference, rebuilt)
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    monkeypatch.setattr(os, "pwrite", pwrite)
    again = prepared.load(model_file)  # written this time
    assert again.cache == "miss"
    same_model(reference, again)


def test_a_write_failing_halfway_or_an_entry_gone_before_it_is_read_builds_in_memory(cache_dir, model_file,
                                                                                      monkeypatch):
    """The tiles written so far are only in the file: when the entry cannot be finished (an I/O error
    on the third write, in the writer thread) or read back (another process deleted it), they are
    built again, in memory."""
    reference = prepared.load(model_file)
    entry = prepared.entry_path(model_file)
    entry.unlink()
    writes = []
    pwrite = os.pwrite

    def failing(fd, data, at):
        writes.append(at)
        if len(writes) == 3:
            raise OSError(errno.EIO, "Input/output error")
        return pwrite(fd, data, at)

    monkeypatch.setattr(os, "pwrite", failing)
    rebuilt = prepared.load(model_file)
    assert len(writes) >= 3 and rebuilt.cache == "off" and not entry.exists()
    assert not list(cache_dir.glob("*.tmp"))  # the half-written entry is deleted
    same_model(reference, rebuilt)
    monkeypatch.setattr(os, "pwrite", pwrite)

    read = prepared._read

    def deleted_first(path, *args):
        if len(args) == 3:  # reading back the entry just written
            path.unlink()
        return read(path, *args)

    monkeypatch.setattr(prepared, "_read", deleted_first)
    rebuilt = prepared.load(model_file)
    assert rebuilt.cache == "off" and not any(in_a_mapping(m.tiles) for m in rebuilt.model.layer_matrices())
    same_model(reference, rebuilt)


def test_half_written_entries_of_ended_processes_are_deleted(cache_dir, model_file):
    cache_dir.mkdir()
    no_process = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    stale = cache_dir / f"x.model.{no_process}.tmp"
    mine = cache_dir / f"y.model.{os.getpid()}.tmp"
    stale.write_bytes(b"half")
    mine.write_bytes(b"half")
    prepared.load(model_file)
    assert not stale.exists() and mine.exists()


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(prepared.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert prepared.cache_dir() == tmp_path / "xdg" / "inferno"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert prepared.cache_dir() == tmp_path / "home" / ".cache" / "inferno"


def test_the_real_model_from_its_entry_generates_the_reference_tokens(cache_dir, model_path):
    """SmolLM2 read from its entry: the greedy tokens of HF's float32 reference."""
    reference = np.load(FIXTURES / "hf_smollm2.npz")
    from inferno.runtime.engine import Engine

    Engine.load(model_path)
    engine = Engine.load(model_path)
    assert engine.startup.model_cache == "hit"
    tokens, _ = greedy(engine, reference["prompt_ids_0"].tolist(), 16)
    assert tokens == reference["continuation_ids"][0][:16].tolist()


def test_the_blas_path_is_warmed_only_by_a_request_that_takes_it(cache_dir):
    """A short prompt never loads the BLAS path's kernels; the first long one does, before its first
    forward, and that time counts as the kernels' part of the start-up."""
    from inferno.runtime.engine import Engine

    engine = Engine.load(FIXTURES / "tiny_llama.gguf")
    loaded = engine.startup.jit_ms
    engine.generate("hi", 2)
    assert engine.startup.jit_ms == loaded
    from inferno.model.transformer import BATCH_ROWS

    long_prompt = "one two three four five six seven eight nine ten " * 2
    assert BATCH_ROWS < len(engine.tokenizer.encode(long_prompt)) <= engine.config.context_length - 2
    engine.generate(long_prompt, 2)
    warmed = engine.startup.jit_ms
    assert warmed > loaded
    engine.generate(long_prompt, 2)
    assert engine.startup.jit_ms == warmed


def test_a_short_request_loads_no_kernel_inside_its_forwards(cache_dir, monkeypatch):
    """The warm-up runs what a short request's forwards run (a prompt of several tokens, then decode
    steps), with the activations the request asks for: no kernel is loaded (or compiled) inside a timed
    forward, where it would count in the time to first token or in a step (Q8_0 weights take a float
    kernel with f32 activations, integer dots with int8)."""
    from numba.core.dispatcher import Dispatcher

    from inferno.runtime.engine import Engine

    engine = Engine.load(FIXTURES / "tiny_qwen3.gguf")
    loaded: list[str] = []
    original = Dispatcher._compile_for_args

    def counting(self, *args, **kws):
        loaded.append(self.py_func.__qualname__)
        return original(self, *args, **kws)

    monkeypatch.setattr(Dispatcher, "_compile_for_args", counting)
    for activations in ("f32", "int8"):
        engine.model.set_activations(activations)
        warmed = engine.startup.jit_ms
        cache = engine.make_cache("prealloc", 6, 3)  # the request's kernels are loaded here
        assert (engine.startup.jit_ms > warmed) == (activations == "int8")  # the load's warm-up ran f32
        loaded.clear()
        engine.model.prefill(np.arange(6), cache)
        for _ in range(3):
            engine.model.decode(1, cache.length, cache)
        assert loaded == [], (activations, loaded)


def test_a_hit_maps_the_weights_before_the_first_forward(cache_dir, model_path, monkeypatch):
    """The pages of the weights every forward reads are mapped at load, in one call per array, so the
    first forward does not fault them in one at a time (without it, it faults several times more)."""
    import resource

    def first_forward_faults() -> int:
        model = prepared.load(model_path).model
        cache = make_cache("prealloc", model.config.kv_geometry, 1)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model.prefill(np.array([1]), cache)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    first_forward_faults()  # the entry, and every kernel loaded
    mapped = first_forward_faults()
    monkeypatch.setattr(prepared, "_map_now", lambda *_: None)
    faulted = first_forward_faults()
    assert faulted > 4 * mapped, (faulted, mapped)
