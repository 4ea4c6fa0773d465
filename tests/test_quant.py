"""inferno.kernels.quant against gguf-py: exact dequantization, and matvec/matmul against a float64 reference.

Every weight goes through a real GGUF file (gguf.GGUFWriter, then gguf.GGUFReader), so from_tensor is
tested on the reader's tensors.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from inferno.errors import InfernoError
from inferno.kernels import activation_parts, nibble_dots, quant, sharing
from inferno.kernels.jit import njit
from inferno.kernels.quant import FUSED, SUPPORTED, QuantizedMatrix, tensor_to_float32
from inferno.kernels.quant_batch import batch_matmul
from inferno.kernels.repack import TILE_BYTES, repack

K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
PACKED_TYPES = tuple(Q(t) for t in nibble_dots.PACKED)  # every type with integer dots


def make_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8[rows, bytes per row] of realistic `qtype` data."""
    if qtype not in K_QUANTS:  # gguf-py quantizes these itself
        data = rng.standard_normal((rows, cols)).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(data, qtype)).view(np.uint8).reshape(rows, -1)
    # gguf-py has no K-quant quantizer: random bytes, with finite f16 super-block scales (d, and dmin
    # for Q4_K/Q5_K) in the range real files use.
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block, type_size), dtype=np.uint8)
    for offset in (208,) if qtype == Q.Q6_K else (0, 2):
        scale = (rng.uniform(1e-4, 2e-2, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2]))
        blocks[..., offset : offset + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, tensors: dict[str, tuple[Q, np.ndarray]]) -> dict[str, gguf.ReaderTensor]:
    """Write {name: (qtype, raw uint8 blocks or a float array)} to a GGUF file and read it back."""
    writer = gguf.GGUFWriter(path, arch="llama")
    for name, (qtype, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=None if data.dtype != np.uint8 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def reference(tensor: gguf.ReaderTensor) -> np.ndarray:
    rows = int(tensor.shape[1])
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(rows, -1)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)  # compare floats bit for bit (tells -0.0 from 0.0, and NaN payloads apart)


def assert_close(got: np.ndarray, w: np.ndarray, x: np.ndarray) -> None:
    """got = x @ w.T (x: [n, cols] or [cols]) within float32 rounding. The bound scales with
    sum(|w| |x|), so one wrong weight or a dropped block (~1/cols of that sum) fails it."""
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert got.dtype == np.float32 and got.shape == exact.shape
    assert np.all(np.abs(got - exact) <= 1e-5 * scale + 1e-30)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 70, 16 * 256 - 10])
def test_repack_writes_every_byte_of_its_tiles(qtype, rows):
    """Tiles are built in memory nobody cleared: whatever it held, every byte is written, and the last
    tile's padding is what rows of zero blocks give (Q4_K and Q6_K fill a chunk of lanes at a time, the
    last one partly past the rows)."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(rows).integers(0, 256, (rows, 2, type_size), np.uint8)
    shape, _ = quant.tile_layout(qtype, [rows], 2 * block)
    padded = np.zeros((shape[0] * shape[3], 2, type_size), np.uint8)
    padded[:rows] = raw
    want, got = np.zeros(shape, np.uint8), np.full(shape, 0xA5, np.uint8)
    repack(padded, want, int(qtype))
    repack(raw, got, int(qtype))
    assert np.array_equal(got, want)


@pytest.mark.parametrize("raw, tiles", [((4, 2, 100), (1, 2, 148, 64)), ((4, 3, 144), (1, 2, 148, 64)),
                                        ((65, 2, 144), (1, 2, 148, 64)), ((4, 2, 144), (1, 2, 144, 64)),
                                        ((4, 2, 144), (1, 2, 148, 96))])
def test_repack_refuses_blocks_that_do_not_fit_their_tiles(raw, tiles):
    """Its kernels read and write unchecked: a block size, block count, row count, tile size or width
    that does not fit is refused before they run."""
    with pytest.raises(ValueError, match=r"do not fit|cannot be"):
        repack(np.zeros(raw, np.uint8), np.zeros(tiles, np.uint8), int(Q.Q4_K))


# rows not a multiple of any tile height, so the last tile is padded (the packed types' tiles: 64 rows, and
# 256 for the matrix of many rows); 512 columns hold 2 K-quant super-blocks
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [2 * 64 + 6, 3, 16 * 256 - 10])
def test_matrix_matches_gguf(tmp_path, qtype, rows):
    rng = np.random.default_rng(int(qtype) * 100 + rows)
    cols = 512
    tensor = write_gguf(tmp_path / "w.gguf", {"w": (qtype, make_blocks(qtype, rows, cols, rng))})["w"]
    m = QuantizedMatrix.from_tensor(tensor)
    assert (m.rows, m.cols, m.qtype, m.name) == (rows, cols, qtype, "w")
    lanes = m.tiles.shape[3]
    assert lanes == (256 if rows > 4000 else 64) if qtype in PACKED_TYPES else quant.TILE_ROWS
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    assert m.nbytes == -(-rows // lanes) * lanes * cols // block * TILE_BYTES.get(int(qtype), type_size)

    ref = reference(tensor)
    assert np.isfinite(ref).all()
    w = m.dequantize()
    assert w.dtype == np.float32 and w.shape == (rows, cols)
    assert np.array_equal(bits(w), bits(ref))
    assert np.array_equal(bits(m.rows_at(np.array([rows - 1]))[0]), bits(ref[rows - 1]))
    ids = np.array([rows - 1, 0, 1, 2, 0, rows - 1])  # unordered, repeated, and a run of neighbours
    assert np.array_equal(bits(m.rows_at(ids)), bits(ref[ids]))

    x = rng.standard_normal(cols).astype(np.float32)
    assert_close(m.matvec(x), ref, x)
    out = np.full(rows, np.nan, np.float32)
    assert m.matvec(x, out) is out
    assert_close(out, ref, x)
    for n in (2, 20):  # short prefills go through matvec, longer ones through BLAS
        xs = rng.standard_normal((n, cols)).astype(np.float32)
        assert_close(m.matmul(xs), ref, xs)


def test_matvec_is_the_same_on_any_thread_count(tmp_path):
    rng = np.random.default_rng(1)
    blocks = make_blocks(Q.Q4_1, 8 * 64, 256, rng)
    tensor = write_gguf(tmp_path / "w.gguf", {"w": (Q.Q4_1, blocks)})["w"]
    m = QuantizedMatrix.from_tensor(tensor)
    x = rng.standard_normal(256).astype(np.float32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = m.matvec(x)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        assert np.array_equal(bits(m.matvec(x)), bits(one))
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
@pytest.mark.parametrize("span", [1, 2, 11])  # spans of one block, an uneven last span, all blocks in one
def test_blas_chunks_hold_every_weight_bit_for_bit_whatever_the_span(tmp_path, qtype, span):
    """Each tile is written in place among the others' columns of W.T (the last tile padded)."""
    rng = np.random.default_rng(3)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    cols = 3 * 256 if block == 256 else 11 * 32
    rows = 2 * 64 + 3
    tensor = write_gguf(tmp_path / "w.gguf", {"w": (qtype, make_blocks(qtype, rows, cols, rng))})["w"]
    m = QuantizedMatrix.from_tensor(tensor)
    tiles, lanes = m._tiles, m._tiles.shape[3]
    out_t = np.full((cols, tiles.shape[0] * lanes), np.nan, np.float32)
    m._kernels.dequantize_transposed(tiles, out_t, span)
    assert np.array_equal(bits(out_t[:, :rows].T), bits(m.dequantize()))


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 20, 64 << 20], ids=["tile-chunks", "uneven", "one-chunk"])
def test_matmul_splits_its_chunks_over_threads_without_changing_a_value(tmp_path, monkeypatch, chunk_bytes):
    rng = np.random.default_rng(2)
    rows, cols = 7 * 64 + 5, 512  # 8 tiles, the last one padded: spans of unequal sizes
    tensor = write_gguf(tmp_path / "w.gguf", {"w": (Q.Q4_K, make_blocks(Q.Q4_K, rows, cols, rng))})["w"]
    m = QuantizedMatrix.from_tensor(tensor)
    x = rng.standard_normal((40, cols)).astype(np.float32)
    monkeypatch.setattr(quant, "MATMUL_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(sharing, "SHARED_FROM_FLOP", 0)  # a product this small would run in one thread
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = m.matmul(x)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        np.testing.assert_allclose(m.matmul(x), one, rtol=1e-6, atol=1e-6)
    finally:
        numba.set_num_threads(before)
    assert_close(one, reference(tensor), x)


def test_tensor_to_float32(tmp_path):
    rng = np.random.default_rng(2)
    norm = rng.standard_normal(64).astype(np.float32)
    bias = rng.standard_normal(64).astype(np.float16)
    tensors = write_gguf(tmp_path / "v.gguf", {"norm": (Q.F32, norm), "bias": (Q.F16, bias)})
    got = tensor_to_float32(tensors["norm"])
    assert got.dtype == np.float32 and np.array_equal(got, norm) and got.flags.writeable
    assert np.array_equal(tensor_to_float32(tensors["bias"]), bias.astype(np.float32))


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.IQ4_NL])
def test_unsupported_type_names_type_and_tensor(tmp_path, qtype):
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((4, 256 // block * type_size), np.uint8)
    tensor = write_gguf(tmp_path / "u.gguf", {"blk.0.odd.weight": (qtype, raw)})["blk.0.odd.weight"]
    for load in (QuantizedMatrix.from_tensor, tensor_to_float32):
        with pytest.raises(InfernoError, match=rf"blk\.0\.odd\.weight.*{qtype.name}"):
            load(tensor)


def test_one_dimensional_tensor_is_not_a_matrix(tmp_path):
    tensor = write_gguf(tmp_path / "v.gguf", {"norm": (Q.F32, np.ones(32, np.float32))})["norm"]
    with pytest.raises(InfernoError, match=r"norm.*2-D"):
        QuantizedMatrix.from_tensor(tensor)


def test_bad_shapes_are_rejected(tmp_path):
    rng = np.random.default_rng(3)
    tensor = write_gguf(tmp_path / "w.gguf", {"w": (Q.Q8_0, make_blocks(Q.Q8_0, 4, 64, rng))})["w"]
    m = QuantizedMatrix.from_tensor(tensor)
    with pytest.raises(ValueError):
        m.matvec(np.ones(63, np.float32))
    with pytest.raises(ValueError):
        m.matvec(np.ones(64, np.float32), out=np.empty(4, np.float64))
    with pytest.raises(IndexError):
        m.rows_at(np.array([4]))


@pytest.fixture(scope="module")
def model(model_path):
    return {t.name: t for t in gguf.GGUFReader(model_path).tensors}


REAL_WEIGHTS = [("blk.3.ffn_down.weight", Q.Q4_1), ("token_embd.weight", Q.Q8_0)]


@pytest.mark.parametrize(("name", "qtype"), REAL_WEIGHTS, ids=lambda v: getattr(v, "name", v))
def test_real_model_weights(model, name, qtype):
    tensor = model[name]
    m = QuantizedMatrix.from_tensor(tensor)
    assert m.qtype == qtype
    ref = reference(tensor)
    assert np.array_equal(bits(m.dequantize()), bits(ref))
    ids = np.array([0, 1, 2, 17, m.rows - 1])
    assert np.array_equal(bits(m.rows_at(ids)), bits(ref[ids]))
    x = np.random.default_rng(4).standard_normal(m.cols).astype(np.float32)
    assert_close(m.matvec(x), ref, x)


def test_stacked_weights_compute_like_separate_ones(tmp_path):
    """q/k/v-like weights of one type stack into one matrix (rows not multiples of a tile: padding
    between parts); a weight of another type stays apart. Same results either way, in decode and
    prefill shapes."""
    from inferno.model.transformer import Projections

    rng = np.random.default_rng(7)
    shapes = {"a": (Q.Q4_1, 70), "b": (Q.Q4_1, 33), "c": (Q.Q8_0, 40), "d": (Q.Q4_1, 64)}
    tensors = write_gguf(tmp_path / "stack.gguf", {
        name: (qtype, make_blocks(qtype, rows, 256, rng)) for name, (qtype, rows) in shapes.items()
    })
    group = Projections.from_tensors([tensors[name] for name in shapes])
    assert [m.qtype for m in group.matrices] == [Q.Q4_1, Q.Q8_0]
    stacked = group.matrices[0]
    assert stacked.parts == [(0, 70), (128, 33), (192, 64)]  # tiles of 64 rows
    np.testing.assert_array_equal(bits(stacked.dequantize()[128:161]), bits(reference(tensors["b"])))
    for n in (1, 3, 20):  # one row (matvec), a few (matvec per row), many (BLAS)
        x = rng.standard_normal((n, 256)).astype(np.float32)
        for name, got in zip(shapes, group(x), strict=True):
            assert_close(got, reference(tensors[name]), x)
            assert got.flags.c_contiguous


def test_int8_activations_round_like_llama_cpp_and_leave_other_types_alone(tmp_path):
    """activations = "int8": the products of the packed types and Q8_0 take x rounded to one int8 per
    value (an error under half a step, max|x|/127 of the block, times the weights), the others (F16)
    stay float32; a name outside ACTIVATIONS is refused."""
    rng = np.random.default_rng(5)
    cols = 256
    x = rng.standard_normal(cols).astype(np.float32)
    for qtype in (*PACKED_TYPES, Q.Q8_0, Q.F16):
        blocks = make_blocks(qtype, 70, cols, rng)
        tensor = write_gguf(tmp_path / f"{qtype.name}.gguf", {"w": (qtype, blocks)})["w"]
        m = QuantizedMatrix.from_tensor(tensor)
        exact = m.matvec(x)
        m.activations = "int8"
        rounded = m.matvec(x)
        w = reference(tensor).astype(np.float64)
        bound = np.abs(w) @ np.repeat(np.abs(x.reshape(-1, 32)).max(axis=1), 32) / 254
        if qtype == Q.F16:
            assert np.array_equal(rounded, exact)
        else:
            assert not np.array_equal(rounded, exact)
            assert np.all(np.abs(rounded - w @ x) <= bound * 1.001 + 1e-4)
        with pytest.raises(ValueError, match="activations 'int4'"):
            m.activations = "int4"


@pytest.mark.parametrize("n_parts", [1, 4])
@pytest.mark.parametrize("vnni", [True, False], ids=["vpdpbusd", "plain-ir"])
@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_packed_dots_of_every_type_on_both_instruction_paths(tmp_path, monkeypatch, qtype, vnni, n_parts):
    """The integer dots of each packed type (repacked tiles, their high-bit planes and sub-block scales),
    generated afresh with and without vpdpbusd: 16 rows of a real tile against two activation rows
    match the dequantized weights to float32 rounding (four parts) or to int8 rounding (one)."""
    if vnni and not nibble_dots.has_vnni():
        pytest.skip("this CPU has no AVX512-VNNI")
    monkeypatch.setattr(nibble_dots, "has_vnni", lambda: vnni)
    rng = np.random.default_rng(int(qtype) + 7 * n_parts)
    cols = 512
    tensor = write_gguf(tmp_path / "w.gguf", {"w": (qtype, make_blocks(qtype, 16, cols, rng))})["w"]
    tile = QuantizedMatrix.from_tensor(tensor).tiles[0]
    x = rng.standard_normal((2, cols)).astype(np.float32)
    parts = np.empty((2, n_parts, cols), np.int8)
    scale, sums = np.empty((2, cols // 32), np.float32), np.empty((2, cols // 16), np.float32)
    for i in range(2):
        activation_parts.split_activations(x[i], parts[i], scale[i], sums[i, : cols // 32])
        if qtype == Q.Q6_K:
            activation_parts.half_sums(x[i], sums[i])
    if qtype != Q.Q6_K:
        sums = np.ascontiguousarray(sums[:, : cols // 32])

    qtype = int(qtype)

    @njit(cache=False)
    def dots(w, parts, scale, sums, acc):  # qtype and n_parts: closure constants, as the kernels' are
        for b in range(scale.shape[1]):
            nibble_dots.quant_dots(w, b, 0, parts, scale, sums, acc, qtype, n_parts, 1)

    acc = np.zeros((2, 64), np.float32)
    dots(tile, parts, scale, sums, acc)
    w = reference(tensor)
    if n_parts == 4:
        assert_close(acc[:, :16], w, x)
    else:
        steps = np.repeat(np.abs(x.reshape(2, -1, 32)).max(axis=2), 32, axis=1)  # max|x| of each block
        bound = np.abs(w.astype(np.float64)) @ steps.T / 254
        assert np.all(np.abs(acc[:, :16] - x @ w.T) <= bound.T * 1.001 + 1e-4)
    assert not acc[:, 16:].any()
    assert ("vpdpbusd" in dots.inspect_asm(dots.signatures[0])) == vnni


def test_every_quantized_type_is_fused():
    """The block types take fused dots (integer ones for the packed types); only the float types'
    matvec dequantizes a tile at a time."""
    assert set(FUSED) == set(SUPPORTED) - {Q.F32, Q.F16, Q.BF16}
    assert set(PACKED_TYPES) == set(FUSED) - {Q.Q8_0}


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_batch_matmul_of_packed_types_is_the_matvec_of_each_row(tmp_path, qtype):
    """A few rows at once (batched decode, short prompts) run each row's own integer dots: bit-identical
    to one matvec per row, with either activations."""
    rng = np.random.default_rng(int(qtype))
    tensor = write_gguf(tmp_path / "w.gguf", {"w": (qtype, make_blocks(qtype, 70, 512, rng))})["w"]
    m = QuantizedMatrix.from_tensor(tensor)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    for activations in ("f32", "int8"):
        m.activations = activations
        assert np.array_equal(batch_matmul(m, x), np.stack([m.matvec(row) for row in x]))
