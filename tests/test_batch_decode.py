"""Batched decoding: every sequence of a batch generates what it generates alone."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType

from inferno.kernels.quant_batch import batch_matmul
from inferno.kv import make_cache
from inferno.kv.paged import PagedKVCache
from inferno.kv.pool import BlockPool
from inferno.model.transformer import BATCH_ROWS

PROMPTS = ("The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at")
NEW_TOKENS = 16


def greedy_batch(engine, caches, prompts):
    """Prefill each prompt into its cache, then decode all together: the greedy tokens of each."""
    model = engine.model
    out = []
    for cache, prompt in zip(caches, prompts, strict=True):
        logits = model.prefill(np.array(engine.tokenizer.encode(prompt)), cache)
        out.append([int(np.argmax(logits))])
    for _ in range(NEW_TOKENS - 1):
        logits = model.decode_batch([tokens[-1] for tokens in out], caches)
        for tokens, row in zip(out, logits, strict=True):
            tokens.append(int(np.argmax(row)))
    return out


def test_each_sequence_of_a_paged_batch_generates_what_it_generates_alone(engine):
    alone = [engine.generate(p, NEW_TOKENS, kv="prealloc", ignore_eos=True).token_ids for p in PROMPTS]
    geometry = engine.config.kv_geometry
    pool = BlockPool.for_tokens(geometry, len(PROMPTS) * 48, block_size=8)
    caches = [PagedKVCache(geometry, 48, pool=pool) for _ in PROMPTS]
    assert greedy_batch(engine, caches, PROMPTS) == alone
    assert len({c.length for c in caches}) > 1  # the sequences really are at different positions
    mixed = [make_cache("prealloc", geometry, 48), make_cache("basic", geometry, 48)]
    assert greedy_batch(engine, mixed, PROMPTS[:2]) == alone[:2]


def test_batch_matmul_is_a_matvec_per_row(engine):
    rng = np.random.default_rng(0)
    layer = engine.model.layers[0]
    for matrix in (layer.qkv.matrices[0], layer.w_down, engine.model.output):  # Q4_1, Q4_1, Q8_0
        for n_rows in (2, 5, 8):  # rows in fours (none, one group and one left over, two groups)
            x = rng.standard_normal((n_rows, matrix.cols), dtype=np.float32)
            expected = np.stack([matrix.matvec(row) for row in x])
            if matrix.qtype == QType.Q8_0:  # summed in another order, four rows at a time
                tolerance = 1e-5 * np.abs(expected).max()
                np.testing.assert_allclose(batch_matmul(matrix, x), expected, rtol=0, atol=tolerance)
            else:  # the 4-bit types run the matvec's own integer dots for each row
                assert np.array_equal(batch_matmul(matrix, x), expected)
            try:  # with int8 activations every one of them does (Q8_0 too)
                matrix.activations = "int8"
                rounded = np.stack([matrix.matvec(row) for row in x])
                assert np.array_equal(batch_matmul(matrix, x), rounded)
            finally:
                matrix.activations = "f32"


def test_int8_activations_take_integer_dots_at_every_length(engine):
    """Past BATCH_ROWS rows the exact path dequantizes weights for BLAS; with int8 activations the
    integer dots of batch_matmul take every row count (what llama.cpp's prefill multiplies in)."""
    model = engine.model
    assert model._matmul_for(1) is None and model._matmul_for(BATCH_ROWS) is batch_matmul
    assert model._matmul_for(BATCH_ROWS + 1) is None
    try:
        model.set_activations("int8")
        assert model._matmul_for(1) is None
        assert model._matmul_for(BATCH_ROWS + 1) is batch_matmul and model._matmul_for(4096) is batch_matmul
    finally:
        model.set_activations("f32")
