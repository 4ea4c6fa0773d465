"""Cache snapshots: bit-exact round trips, resumed generation equal to a fresh one, and every refusal."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from inferno.cli.generate import main as generate_main
from inferno.cli.inspect import main as inspect_main
from inferno.errors import InfernoError
from inferno.file.reader import open_gguf
from inferno.kv import LAYOUTS
from inferno.kv.snapshot import Snapshot, model_fingerprint

FIXTURES = Path(__file__).parent / "fixtures"
PROMPT = "Once upon a time"
PROMPT_IDS = [6403, 1980, 253, 655]


@pytest.fixture
def cli(run_main, loaded_once, model_path):
    def model_generate(*args):
        return run_main(generate_main, "model-generate", "--json", model_path, *args)

    return model_generate


@pytest.fixture(scope="module")
def prompt_snapshot(engine, tmp_path_factory):
    """A saved snapshot of PROMPT alone: a one-token run leaves exactly the prompt in the cache."""
    cache = engine.make_cache("prealloc", len(PROMPT_IDS), 1)
    result = engine.run(PROMPT_IDS, 1, ignore_eos=True, cache=cache)
    path = tmp_path_factory.mktemp("snapshots") / "prompt.safetensors"
    Snapshot.from_cache(cache, PROMPT_IDS + result.token_ids, engine.config, engine.fingerprint).save(path)
    return path


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_refused(result, prog: str, *fragments: str) -> None:
    code, out, err = result
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# -- the file ------------------------------------------------------------------------------------


def test_round_trip_is_bit_exact_and_restores_into_every_cache_kind(engine, tmp_path):
    cache = engine.make_cache("basic", 6, 3)
    result = engine.run([1, *PROMPT_IDS, 28], 3, ignore_eos=True, cache=cache)
    run_ids = [1, *PROMPT_IDS, 28, *result.token_ids]
    assert cache.length == 8  # the last sampled token is never fed back
    path = tmp_path / "run.safetensors"
    Snapshot.from_cache(cache, run_ids, engine.config, engine.fingerprint).save(path)

    loaded = Snapshot.load(path)
    assert loaded.token_ids.tolist() == run_ids[:8]
    assert loaded.token_ids.dtype == np.int32 and loaded.keys.dtype == np.float32
    assert loaded.keys.shape == loaded.values.shape == (30, 8, 192)
    assert (loaded.architecture, loaded.fingerprint) == ("llama", engine.fingerprint)
    options = {"window": {"window": 8}}  # 4 sinks + 8: the snapshot's 8 tokens, nothing evicted
    for layout in LAYOUTS:
        restored = engine.make_cache(layout, 9, 3, 12, **options.get(layout, {}))
        assert loaded.restore(restored, [*run_ids[:8], 42]) == 8
        for layer in range(30):
            for ours, theirs in zip(restored.read(layer), cache.read(layer), strict=True):
                assert ours.tobytes() == theirs.tobytes()


def test_header_is_plain_json_strings(prompt_snapshot):
    raw = prompt_snapshot.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    meta = header["__metadata__"]
    assert meta["format"] == "inferno-kv-snapshot" and meta["version"] == "1"
    assert (meta["architecture"], meta["layers"], meta["kv_heads"], meta["heads"], meta["head_dim"]) == (
        "llama", "30", "3", "9", "64"
    )
    assert len(meta["fingerprint"]) == len(meta["data_sha256"]) == 64
    assert header["keys"]["dtype"] == "F32" and header["keys"]["shape"] == [30, 4, 192]
    assert header["token_ids"]["dtype"] == "I32" and header["token_ids"]["shape"] == [4]


def fingerprint_by_spec(path: Path) -> str:
    """The fingerprint as the snapshot module's docstring specifies it, from the stock gguf reader's
    metadata and the file's own bytes."""
    reader = gguf.GGUFReader(path)

    def meta(key: str):
        return reader.fields[key].contents()

    arch = meta("general.architecture")
    heads = meta(f"{arch}.attention.head_count")
    head_dim = (meta(f"{arch}.attention.key_length") if f"{arch}.attention.key_length" in reader.fields
                else meta(f"{arch}.embedding_length") // heads)
    geometry = {"layers": meta(f"{arch}.block_count"), "kv_heads": meta(f"{arch}.attention.head_count_kv"),
                "heads": heads, "head_dim": head_dim}
    digest = hashlib.sha256(json.dumps([arch, geometry]).encode())
    with path.open("rb") as f:
        for tensor in reader.tensors:
            shape = [int(n) for n in tensor.shape]
            digest.update(f"\n{tensor.name} {shape} {tensor.tensor_type.name}\n".encode())
            f.seek(tensor.data_offset)
            digest.update(f.read(64))
    return digest.hexdigest()


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_fingerprint_follows_its_specification(name):
    path = FIXTURES / f"{name}.gguf"
    assert model_fingerprint(open_gguf(path)) == fingerprint_by_spec(path)


def test_the_models_fingerprint_follows_its_specification(engine, model_path):
    assert engine.fingerprint == fingerprint_by_spec(model_path)


def test_fingerprint_tells_weights_apart_by_their_first_bytes(tmp_path):
    original = FIXTURES / "tiny_llama.gguf"
    tensor = next(t for t in gguf.GGUFReader(original).tensors if t.name == "blk.1.ffn_down.weight")

    def fingerprint_with_byte_flipped(offset: int) -> str:
        data = bytearray(original.read_bytes())
        data[tensor.data_offset + offset] ^= 0xFF
        path = tmp_path / f"flipped_{offset}.gguf"
        path.write_bytes(data)
        return model_fingerprint(open_gguf(path))

    ours = model_fingerprint(open_gguf(original))
    assert fingerprint_with_byte_flipped(3) != ours  # another fine-tune of the same shapes
    assert fingerprint_with_byte_flipped(100) == ours  # past the bytes sampled: the rest is not read


def test_a_prompt_equal_to_the_snapshot_leaves_its_last_token_to_prefill(engine, prompt_snapshot):
    cache = engine.make_cache("prealloc", 4, 1)
    assert Snapshot.load(prompt_snapshot).restore(cache, PROMPT_IDS) == 3
    assert cache.length == 3


# -- resuming ------------------------------------------------------------------------------------


def test_resumed_generation_is_identical_to_a_fresh_one(engine, prompt_snapshot):
    longer = [*PROMPT_IDS, 28, 957, 436]  # the prompt, then more tokens
    fresh = engine.run(longer, 8, ignore_eos=True, cache=engine.make_cache("prealloc", 7, 8))
    cache = engine.make_cache("prealloc", 7, 8)
    Snapshot.load(prompt_snapshot).restore(cache, longer)
    resumed = engine.run(longer, 8, ignore_eos=True, cache=cache)
    assert resumed.token_ids == fresh.token_ids
    assert resumed.metrics.prefilled_tokens == 3


def test_load_cache_from_the_command_line_gives_the_same_output(cli, tmp_path, prompt_snapshot):
    before = sha256(prompt_snapshot)
    code, out, err = cli(PROMPT, 6)
    assert code == 0, err
    fresh = json.loads(out)
    code, out, err = cli("--load-cache", prompt_snapshot, PROMPT, 6)
    assert code == 0, err
    resumed = json.loads(out)
    assert resumed["token_ids"] == fresh["token_ids"]
    assert resumed["metrics"]["prefilled_tokens"] == 1 and resumed["metrics"]["cache"] == "prealloc"
    assert resumed["metrics"]["load_cache_ms"] > 0
    assert sha256(prompt_snapshot) == before


def test_save_cache_then_continue_the_text(cli, engine, tmp_path):
    saved = tmp_path / "first.safetensors"
    code, out, err = cli("--save-cache", saved, PROMPT, 4)
    assert code == 0, err
    first = json.loads(out)
    held = first["prompt_ids"] + first["token_ids"][:-1]  # the last sampled token never went in
    assert Snapshot.load(saved).token_ids.tolist() == held

    follow = engine.tokenizer.decode(held) + " and then"
    second = tmp_path / "second.safetensors"
    code, out, err = cli("--kv", "basic", "--load-cache", saved, "--save-cache", second, follow, 3)
    assert code == 0, err
    resumed = json.loads(out)
    assert resumed["prompt_ids"][: len(held)] == held
    assert resumed["metrics"]["prefilled_tokens"] == len(resumed["prompt_ids"]) - len(held)
    assert resumed["metrics"]["cache"] == "basic"
    assert Snapshot.load(second).length == len(resumed["prompt_ids"]) + 2


# -- refusals: one line, exit 2, the snapshot untouched ----------------------------------------------


def resaved(snapshot_path, tmp_path, **changes):
    """The snapshot with some fields changed, saved as a consistent file (valid checksum)."""
    path = tmp_path / "changed.safetensors"
    dataclasses.replace(Snapshot.load(snapshot_path), **changes).save(path)
    return path


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"fingerprint": "0" * 64}, "same shape, different weights"),
        ({"architecture": "qwen2"}, "from another model (qwen2"),
    ],
)
def test_a_snapshot_of_another_model_is_refused(cli, prompt_snapshot, tmp_path, changes, message):
    other = resaved(prompt_snapshot, tmp_path, **changes)
    before = sha256(other)
    assert_refused(cli("--load-cache", other, PROMPT, 2), "model-generate", message)
    assert sha256(other) == before


def test_a_snapshot_is_refused_by_a_really_different_model(run_main, prompt_snapshot):
    tiny = FIXTURES / "tiny_llama.gguf"
    if not tiny.is_file():
        pytest.skip("tests/fixtures/tiny_llama.gguf is absent")
    result = run_main(generate_main, "model-generate", "--load-cache", prompt_snapshot, tiny, "abc", 2)
    assert_refused(result, "model-generate", "from another model (llama, 30 layers", "(llama, 2 layers")


@pytest.mark.parametrize(
    "prompt, message",
    [("The sky is", "does not begin with the snapshot's 4 tokens: at position 0"),
     ("Once upon", "shorter than the snapshot's 4 tokens")],
)
def test_a_prompt_that_does_not_extend_the_snapshot_is_refused(cli, prompt_snapshot, prompt, message):
    before = sha256(prompt_snapshot)
    assert_refused(cli("--load-cache", prompt_snapshot, prompt, 2), "model-generate", message)
    assert sha256(prompt_snapshot) == before


def test_saving_over_the_loaded_snapshot_is_refused(cli, prompt_snapshot):
    before = sha256(prompt_snapshot)
    result = cli("--load-cache", prompt_snapshot, "--save-cache", prompt_snapshot, PROMPT, 2)
    assert_refused(result, "model-generate", "never modified")
    assert sha256(prompt_snapshot) == before


def broken_files(snapshot_path, tmp_path):
    """(file, what the refusal says) for every way a snapshot file can be damaged."""
    raw = snapshot_path.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    flipped = bytearray(raw)
    flipped[header_end + 100] ^= 0x40  # one bit of a key
    header = json.loads(raw[8:header_end])
    del header["__metadata__"]["fingerprint"]
    unsigned = json.dumps(header).encode()
    cases = {
        "no fingerprint": (len(unsigned).to_bytes(8, "little") + unsigned + raw[header_end:],
                           "missing or bad 'fingerprint'"),
        "truncated": (raw[: len(raw) // 2], "truncated or corrupt"),
        "header cut": (raw[:40], "truncated or corrupt"),
        "garbage": (b"\xff" * 64, "truncated or corrupt"),
        "empty": (b"", "truncated or corrupt"),
        "bit flip": (bytes(flipped), "does not match its checksum"),
        "not ours": (raw.replace(b"inferno-kv-snapshot", b"someone-elses-cache"), "not a KV cache snapshot"),
        "newer": (raw.replace(b'"version":"1"', b'"version":"9"'), "format version 9"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        path.write_bytes(data)
        yield path, message


def test_damaged_files_are_refused_without_the_model(run_main, prompt_snapshot, tmp_path):
    for path, message in broken_files(prompt_snapshot, tmp_path):
        before = sha256(path)
        with pytest.raises(InfernoError, match=message):
            Snapshot.load(path)
        assert_refused(run_main(inspect_main, "kv-inspect", path), "kv-inspect", message)
        assert sha256(path) == before


def test_damaged_files_are_refused_by_model_generate(cli, prompt_snapshot, tmp_path):
    for path, message in broken_files(prompt_snapshot, tmp_path):
        before = sha256(path)
        assert_refused(cli("--load-cache", path, PROMPT, 2), "model-generate", message)
        assert sha256(path) == before
    assert_refused(cli("--load-cache", tmp_path / "absent.st", PROMPT, 2), "model-generate", "no such file")
