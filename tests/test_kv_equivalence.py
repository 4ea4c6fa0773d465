"""With a cache or without, the model must say the same thing: same tokens, logits within 1e-4.

The naive path reruns the whole sequence every step; the cached paths prefill once and decode one
token at a time. Both are driven with the same tokens so every step's logits can be compared.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FIXTURES

from inferno.kv import make_cache

NEW_TOKENS = 128
TOLERANCE = 1e-4
LOGITS = np.load(FIXTURES / "hf_smollm2.npz")
SHORT = LOGITS["prompt_ids_0"].tolist()  # "Once upon a time": 4 tokens
LONG = LOGITS["prompt_ids_5"].tolist()  # 598 tokens


@pytest.fixture(scope="module", params=[SHORT, LONG], ids=["4-token", "598-token"])
def naive_run(request, engine):
    """Greedy tokens and per-step logits with no cache at all."""
    ids = list(request.param)
    tokens, logits = [], []
    for _ in range(NEW_TOKENS):
        step = engine.model.forward(np.array(ids + tokens))
        logits.append(step)
        tokens.append(int(np.argmax(step)))
    return request.param, tokens, logits


@pytest.mark.parametrize("mode", ["basic", "prealloc"])
def test_cached_decoding_matches_the_naive_path(engine, naive_run, mode):
    prompt, naive_tokens, naive_logits = naive_run
    cache = make_cache(mode, engine.config.kv_geometry, len(prompt) + NEW_TOKENS)
    logits = engine.model.prefill(np.array(prompt), cache)
    tokens = []
    for step in range(NEW_TOKENS):
        np.testing.assert_allclose(logits, naive_logits[step], rtol=0, atol=TOLERANCE, err_msg=f"step {step}")
        tokens.append(int(np.argmax(logits)))
        if step + 1 < NEW_TOKENS:
            logits = engine.model.decode(tokens[-1], len(prompt) + step, cache)
    assert tokens == naive_tokens
    assert cache.length == len(prompt) + NEW_TOKENS - 1
    expected_rows = cache.length if mode == "basic" else cache.capacity
    assert cache.nbytes == 2 * 30 * expected_rows * 3 * 64 * 4


def test_decode_refuses_a_position_the_cache_does_not_hold(engine):
    cache = make_cache("prealloc", engine.config.kv_geometry, 8)
    engine.model.prefill(np.array(SHORT), cache)
    with pytest.raises(ValueError, match="position 6"):
        engine.model.decode(42, 6, cache)


def test_prefill_continues_after_cached_tokens(engine):
    """Prefilling a prompt in two pieces gives the logits of prefilling it whole."""
    whole = make_cache("prealloc", engine.config.kv_geometry, len(LONG))
    want = engine.model.prefill(np.array(LONG), whole)
    split = make_cache("prealloc", engine.config.kv_geometry, len(LONG))
    engine.model.prefill(np.array(LONG[:300]), split)
    got = engine.model.prefill(np.array(LONG[300:]), split)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(split.read(29)[0], whole.read(29)[0], rtol=0, atol=1e-4)
