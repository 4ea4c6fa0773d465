"""KV element types: llama.cpp's bytes (checked against gguf-py's quantizers), bounded rounding error,
attention on stored rows, exact sizes (kv-memcalc agrees), snapshots, and what each costs in quality
on real text with the default model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FIXTURES
from gguf import GGMLQuantizationType, quants

from inferno.errors import InfernoError
from inferno.kernels.attention import attention_decode
from inferno.kv import DTYPES, LAYOUTS, KVGeometry, make_cache, planned_nbytes
from inferno.kv.dtypes import element_type
from inferno.kv.snapshot import Snapshot

GEOMETRY = KVGeometry(layers=2, kv_heads=3, heads=9, head_dim=64)
GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


def key_like_rows(n: int = 40, seed: int = 0) -> np.ndarray:
    """Rows [n, kv_width] shaped like cached keys: a few huge channels, rows of very different sizes,
    an all-zero block and a lone outlier (the cases scales are made of)."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n, GEOMETRY.kv_width)) * np.exp(rng.standard_normal((n, 1)))
    rows[:, [5, 70, 133]] *= 30
    rows[3, 32:64] = 0
    rows[7, 100] = 4000.0
    return rows.astype(np.float32)


@pytest.mark.parametrize("name", GGML)
def test_blocks_are_byte_for_byte_gguf_pys_quantization(name):
    rows = key_like_rows()
    ours = element_type(name).encode(rows, GEOMETRY)
    theirs = quants.quantize(rows, GGML[name])
    assert ours.dtype == np.uint8 and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)
    decoded = element_type(name).decode(ours, GEOMETRY)
    np.testing.assert_array_equal(decoded, quants.dequantize(theirs, GGML[name]))


def block_max(rows: np.ndarray) -> np.ndarray:
    """Largest |value| of the 32-value block each value is in."""
    blocks = np.abs(rows).reshape(rows.shape[0], -1, 32).max(axis=-1, keepdims=True)
    return np.broadcast_to(blocks, (*blocks.shape[:2], 32)).reshape(rows.shape)


@pytest.mark.parametrize(
    ("name", "bound"),
    [
        ("f16", lambda x: np.abs(x) * 2.0**-11 + 2.0**-24),
        ("q8_0", lambda x: block_max(x) * (1 / 254 + 2.0**-11)),  # half a step, plus the f16 scale
        ("q4_0", lambda x: block_max(x) * (1 / 8 + 2.0**-10)),  # a step where +max clips to 7
    ],
)
def test_rounding_error_is_bounded_per_value(name, bound):
    rows = key_like_rows()
    t = element_type(name)
    error = np.abs(t.decode(t.encode(rows, GEOMETRY), GEOMETRY) - rows)
    assert (error <= bound(rows)).all()
    assert error.max() > 0


@pytest.mark.parametrize(("name", "step"), [("q4_0h", 1 / 8 + 2.0**-10), ("q8_0h", 1 / 254 + 2.0**-11)])
def test_rotated_error_is_bounded_per_head_and_smaller_than_unrotated_where_channels_are_huge(name, step):
    rows = key_like_rows()
    t = element_type(name)
    error = t.decode(t.encode(rows, GEOMETRY), GEOMETRY) - rows
    heads = rows.reshape(-1, GEOMETRY.head_dim)
    h = heads.copy()
    from inferno.kv.blocks import hadamard_rows

    hadamard_rows(h, GEOMETRY.head_dim)  # orthonormal: the error's norm is the rotated error's
    bound = np.abs(h).reshape(len(h), 2, 32).max(axis=-1) * step
    per_head = np.linalg.norm(error.reshape(-1, GEOMETRY.head_dim), axis=1)
    assert (per_head <= np.sqrt(32 * (bound**2).sum(axis=1))).all()
    plain = element_type(name[:-1])
    plain_error = plain.decode(plain.encode(rows, GEOMETRY), GEOMETRY) - rows
    smooth = slice(8, None)  # past the lone outlier, which a rotation spreads over its whole head
    assert np.linalg.norm(error[smooth]) < 0.5 * np.linalg.norm(plain_error[smooth])


@pytest.mark.parametrize("name", [d for d in DTYPES if d not in ("f32", "q4_kivi", "q4_recent")])
def test_attention_reads_the_stored_rows_as_their_decoded_floats(name):
    t = element_type(name)
    rng = np.random.default_rng(1)
    keys, values = key_like_rows(300, 2) / 10, key_like_rows(300, 3) / 10
    query = rng.standard_normal(GEOMETRY.heads * GEOMETRY.head_dim).astype(np.float32)
    k, v = t.encode(keys, GEOMETRY), t.encode(values, GEOMETRY)
    ours = t.attend(query, k, v, GEOMETRY)
    floats = attention_decode(query, t.decode(k, GEOMETRY), t.decode(v, GEOMETRY), GEOMETRY.heads)
    np.testing.assert_allclose(ours, floats, rtol=1e-4, atol=1e-4 * np.abs(floats).max())


def test_kivi_rounds_whole_groups_per_channel_and_attends_on_them():
    """Written row by row past two groups: the groups' keys come back within half a step of their
    channel (its range / 15 / 2), the open rows within f16's rounding, and attention on the codes
    equals attention over the decoded rows."""
    rng = np.random.default_rng(4)
    keys = (rng.standard_normal((150, GEOMETRY.kv_width)) + 20 * rng.standard_normal(GEOMETRY.kv_width))
    keys, values = keys.astype(np.float32), key_like_rows(150, 5)
    cache = make_cache("prealloc", GEOMETRY, 200, "q4_kivi")
    for layer in range(GEOMETRY.layers):
        cache.write(layer, 0, keys[:100], values[:100])
        for pos in range(100, 150):
            cache.write(layer, pos, keys[pos : pos + 1], values[pos : pos + 1])
    cache.commit(150)
    k, v = cache.read(1)
    for start in (0, 64):
        group = keys[start : start + 64]
        step = (group.max(axis=0) - group.min(axis=0)) / 15
        assert (np.abs(k[start : start + 64] - group) <= step * 0.51 + np.abs(group) * 2.0**-10).all()
    np.testing.assert_allclose(k[128:], keys[128:], rtol=2.0**-11)
    query = rng.standard_normal(GEOMETRY.heads * GEOMETRY.head_dim).astype(np.float32)
    floats = attention_decode(query, k, v, GEOMETRY.heads)
    np.testing.assert_allclose(cache.attend(1, query, 150), floats, rtol=1e-4, atol=1e-5)


def test_recent_keeps_its_newest_rows_in_q8_0_and_keys_minus_their_segment_mean():
    """Written in chunks and row by row past two segments of 128: the newest 22 rows come back as
    q8_0 of the rotated rows, the others within a step of 4 bits per rotated head of the key minus its
    segment's mean, which takes a channel's constant part out (far closer than q4_0h where channels
    carry one); attention on the stored forms equals attention over the decoded rows, from position 0
    or over a sliding window, with the ring's slots wrapped or not."""
    from inferno.kv.blocks import hadamard_rows

    rng = np.random.default_rng(6)
    keys = rng.standard_normal((300, GEOMETRY.kv_width)) + 20 * rng.standard_normal(GEOMETRY.kv_width)
    keys, values = keys.astype(np.float32), key_like_rows(300, 7)
    cache = make_cache("prealloc", GEOMETRY, 400, "q4_recent")
    query = rng.standard_normal(GEOMETRY.heads * GEOMETRY.head_dim).astype(np.float32)
    for end in (140, 300):  # the ring's slots wrap at 300 (300 % 22 = 14), not at 140 (0 .. 21 hold 118 ..)
        for layer in range(GEOMETRY.layers):
            begin = cache.layer_length(layer)
            cache.write(layer, begin, keys[begin : end - 5], values[begin : end - 5])
            for pos in range(end - 5, end):
                cache.write(layer, pos, keys[pos : pos + 1], values[pos : pos + 1])
        cache.commit(end - cache.length)
        k, v = cache.read(1)
        for start in (0, 130, end - 10):
            floats = attention_decode(query, k[start:], v[start:], GEOMETRY.heads)
            np.testing.assert_allclose(cache.store.attend(1, query, end, start), floats, rtol=1e-4, atol=1e-5)
    ring = element_type("q8_0")
    rotated = keys.copy()
    hadamard_rows(rotated, GEOMETRY.head_dim)
    again = ring.decode(ring.encode(rotated[-22:], GEOMETRY), GEOMETRY)
    hadamard_rows(again, GEOMETRY.head_dim)
    np.testing.assert_allclose(k[-22:], again, rtol=1e-5, atol=1e-5)
    old = slice(128, 278)  # past the first segment, which has no mean to take out
    error = np.linalg.norm((k[old] - keys[old]).reshape(-1, GEOMETRY.head_dim), axis=1)
    residual = rotated[old] - rotated[0:128].mean(axis=0)  # segment 1 is 128 .. 255; 256 .. on
    residual[128:] = rotated[256:278] - rotated[128:256].mean(axis=0)
    step = np.abs(residual.reshape(-1, GEOMETRY.head_dim)).max(axis=1) / 8
    assert (error <= 1.05 * step * np.sqrt(GEOMETRY.head_dim)).all()  # 5%: the means' own rounding
    q4h = element_type("q4_0h")
    plain = q4h.decode(q4h.encode(keys[old], GEOMETRY), GEOMETRY) - keys[old]
    assert error.sum() < 0.2 * np.linalg.norm(plain.reshape(-1, GEOMETRY.head_dim), axis=1).sum()


def every_layout_and_dtype():
    return [(layout, dtype) for layout, cls in LAYOUTS.items() for dtype in cls.dtypes]


LAYOUT_OPTIONS = {"window": {"window": 16, "positions": "original"}}  # what a layout needs to be made


@pytest.mark.parametrize(("layout", "dtype"), every_layout_and_dtype())
def test_planned_bytes_are_what_the_cache_allocates(layout, dtype):
    options = LAYOUT_OPTIONS.get(layout, {})
    cache = make_cache(layout, GEOMETRY, 50, dtype, **options)
    for layer in range(GEOMETRY.layers):
        cache.write(layer, 0, key_like_rows(50), key_like_rows(50, 1))
    cache.commit(50)
    assert cache.nbytes == planned_nbytes(layout, GEOMETRY, 50, dtype, **options)
    if layout in ("window", "paged"):  # they hold the window, or whole blocks: their own tests count them
        return
    if dtype == "q4_kivi":  # no whole group of 64 yet: all 50 rows wait in f16 (the open group holds 64)
        assert cache.nbytes == 2 * GEOMETRY.layers * 64 * GEOMETRY.kv_width * 2
        assert planned_nbytes(layout, GEOMETRY, 6400, dtype) == 2 * GEOMETRY.layers * GEOMETRY.kv_width * (
            6400 * 4.5 / 8 + 64 * 2)
    elif dtype == "q4_recent":  # 28 rows of 4.25 bits and the 22 of the ring in q8_0; no key mean yet
        assert cache.nbytes == 2 * GEOMETRY.layers * GEOMETRY.kv_width * (28 * 4.25 + 22 * 8.5) / 8
        body, means = 6400 - 22, -(-6378 // 128) - 1  # a mean for every segment of 128 but the first
        assert planned_nbytes(layout, GEOMETRY, 6400, dtype) == GEOMETRY.layers * GEOMETRY.kv_width * (
            2 * (body * 4.25 + 22 * 8.5) / 8 + means * 2)
    else:
        bits = {"f32": 32, "f16": 16, "q8_0": 8.5, "q8_0h": 8.5, "q4_0": 4.5, "q4_0h": 4.5}[dtype]
        assert cache.nbytes == 2 * GEOMETRY.layers * 50 * GEOMETRY.kv_width * bits / 8


def test_unknown_or_unsupported_element_types_are_refused():
    with pytest.raises(InfernoError, match=r"'q3' is not one of f32, f16"):
        make_cache("prealloc", GEOMETRY, 4, "q3")
    with pytest.raises(InfernoError, match="a basic cache holds f32 rows, not q8_0"):
        make_cache("basic", GEOMETRY, 4, "q8_0")
    with pytest.raises(InfernoError, match=r"blocks of 32 values along head_dim.*head_dim of 48"):
        make_cache("prealloc", KVGeometry(1, 1, 1, 48), 4, "q4_0")


def test_kv_memcalc_prints_the_runtimes_bytes_for_every_kind_and_dtype(engine, model_path):
    from click.testing import CliRunner

    from inferno.cli.memcalc import command

    for layout, dtype in every_layout_and_dtype():
        every_layer = f"0-{engine.config.n_layers - 1}"
        window = ["--sliding-window", "64", "--sliding-layers", every_layer] if layout == "window" else []
        result = CliRunner().invoke(command, ["--model", str(model_path), "--kv", layout, "--kv-dtype", dtype,
                                              "--context", "100,2048", "--json", *window])
        assert result.exit_code == 0, result.output
        rows = json.loads(result.output)["rows"]
        for row in rows:
            n = row["context"]
            options = {"window": 64} if layout == "window" else {}
            cache = engine.make_cache(layout, 1, n - 1, n if layout == "window" else None, dtype, **options)
            full = np.zeros((n, cache.kv_width), np.float32)
            for layer in range(cache.n_layers):  # held at capacity: what a layout that grows reaches
                cache.write(layer, 0, full, full)
            assert row["bytes"] == cache.nbytes, (layout, dtype, row)


def filled(engine, dtype: str, text: str = "The capital of France is Paris, and"):
    ids = engine.tokenizer.encode(text)
    cache = engine.make_cache("prealloc", len(ids), 1, dtype=dtype)
    engine.model.prefill(np.array(ids), cache)
    return cache, ids


def test_a_quantized_snapshot_keeps_its_blocks_and_loads_into_any_element_type(engine, tmp_path):
    cache, ids = filled(engine, "q8_0")
    path = tmp_path / "q8.safetensors"
    Snapshot.from_cache(cache, ids, engine.config, engine.fingerprint).save(path)
    loaded = Snapshot.load(path)
    assert loaded.dtype == "q8_0" and loaded.keys.dtype == np.uint8
    for dtype in ("q8_0", "f32", "q4_0"):
        target = engine.make_cache("prealloc", len(ids) + 1, 1, dtype=dtype)
        loaded.restore(target, [*ids, 1])
        for layer in (0, 29):
            want = cache.read(layer)[0]  # the q8_0 rows as floats
            if dtype == "q8_0":
                np.testing.assert_array_equal(target.stored_rows(layer)[0], cache.stored_rows(layer)[0])
            elif dtype == "f32":
                np.testing.assert_array_equal(target.read(layer)[0], want)
            else:
                again = element_type("q4_0").encode(want, engine.config.kv_geometry)
                np.testing.assert_array_equal(target.stored_rows(layer)[0], again)


def test_model_generate_reports_the_element_type_and_its_bytes(run_main, model_path):
    from inferno.cli.generate import main

    args = (str(model_path), "Hello", "4")
    code, out, err = run_main(main, "model-generate", "--kv", "prealloc", "--kv-dtype", "q4_0h", *args,
                              "--json")
    assert code == 0, err
    metrics = json.loads(out)["metrics"]
    assert metrics["cache_dtype"] == "q4_0h"
    smollm2 = KVGeometry(30, 3, 9, 64)
    assert metrics["cache_bytes"] == planned_nbytes("prealloc", smollm2, metrics["cache_capacity"], "q4_0h")
    code, _, err = run_main(main, "model-generate", "--kv", "basic", "--kv-dtype", "q8_0", *args)
    assert code == 2 and err.count("\n") == 1 and "basic cache holds f32 rows, not q8_0" in err


def test_fidelity_on_english_text(engine):
    """128 tokens of the Python Language Reference through each element type (kv-bench --fidelity)."""
    from inferno.analysis.fidelity import measure

    ids = engine.tokenizer.encode((FIXTURES / "execution_model.txt").read_text())[:128]
    dtypes = ["f16", "q8_0", "q8_0h", "q4_0", "q4_0h", "q4_kivi", "q4_recent"]
    rows = {r.dtype: r for r in measure(engine.model, ids, dtypes)}
    assert rows["f32"].kl_mean == 0 and rows["f32"].top1_agreement == 1
    assert rows["f16"].kl_mean < 1e-5
    # llama.cpp's q8_0 to the byte: 5.9e-4 to 6.8e-4 on this excerpt as the float sums around it are
    # regrouped, over the 5e-4 the issue aimed for; 1 to 4 of its 127 choices flip at near-ties.
    # The same blocks over rotated heads (q8_0h) lose a quarter of that: 1.7e-4.
    assert rows["q8_0"].kl_mean <= 1e-3 and rows["q8_0"].top1_agreement >= 0.96
    assert rows["q8_0h"].kl_mean <= min(5e-4, rows["q8_0"].kl_mean / 2)
    assert rows["q8_0h"].top1_agreement >= 0.96
    assert rows["q4_kivi"].kl_mean <= 0.02 and rows["q4_kivi"].top1_agreement >= 0.95
    assert rows["q4_recent"].kl_mean <= 0.02 and rows["q4_recent"].top1_agreement >= 0.95
    assert rows["q4_0"].kl_mean > rows["q4_0h"].kl_mean > 2 * rows["q4_kivi"].kl_mean


def test_int8_activations_cost_measured_and_reported(run_main, engine, model_path):
    """--activations int8: the fidelity rows besides the reference take int8 activations (and the
    model is left as it was); model-generate's JSON says which arithmetic made its tokens."""
    from inferno.analysis.fidelity import measure
    from inferno.cli.generate import main

    ids = engine.tokenizer.encode((FIXTURES / "execution_model.txt").read_text())[:64]
    reference, rounded = measure(engine.model, ids, ["f32"], activations="int8")
    assert (reference.activations, rounded.activations) == ("f32", "int8")
    assert reference.kl_mean == 0 and 0 < rounded.kl_mean < 0.05 and rounded.top1_agreement >= 0.85
    assert engine.model.activations == "f32"
    args = (str(model_path), "Hello", "4", "--json")
    code, out, err = run_main(main, "model-generate", "--activations", "int8", *args)
    assert code == 0, err
    assert json.loads(out)["metrics"]["activations"] == "int8"
    code, out, _ = run_main(main, "model-generate", *args)
    assert json.loads(out)["metrics"]["activations"] == "f32"
    code, out, err = run_main(main, "model-generate", "--num-samples", "2", "--activations", "int8", *args)
    assert code == 0, err
    assert json.loads(out)["metrics"]["activations"] == "int8"  # batched decoding reports it too
    code, _, err = run_main(main, "model-generate", "--activations", "q4", *args)
    assert code == 2 and err.count("\n") == 1 and "--activations 'q4': expected one of f32, int8" in err


def test_kv_bench_fidelity_json_and_bad_element_types(run_main, model_path):
    from inferno.cli.kv_bench import main

    code, out, err = run_main(main, "kv-bench", str(model_path), "--fidelity", "--kv-dtype", "q8_0",
                              "--tokens", "8", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["tokens"] == 8 and "pydoc_data" in report["text"]
    assert [r["dtype"] for r in report["rows"]] == ["f32", "q8_0"]
    assert report["rows"][1]["bits_per_value"] == 8.5
    code, _, err = run_main(main, "kv-bench", str(model_path), "--fidelity", "--kv-dtype", "q3")
    assert code == 2 and err.count("\n") == 1 and "unknown element type q3" in err
