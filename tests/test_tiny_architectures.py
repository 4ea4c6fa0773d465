"""llama, qwen2 and qwen3 on tiny random-weight GGUFs against HF transformers' float32 logits.

tests/reference/make_tiny_models.py wrote each GGUF as llama.cpp's converter would (llama's q/k
permuted for adjacent-pair RoPE; qwen2 with q/k/v biases; qwen3 with per-head q/k norms), with
matrices in F32, F16 and Q8_0 respectively, and recorded HF's logits for the same weights.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FIXTURES

from inferno.file.reader import open_gguf
from inferno.kv import make_cache
from inferno.model.transformer import Transformer

ARCHS = ["llama", "qwen2", "qwen3"]
TOLERANCE = 1e-3


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request):
    model = Transformer.from_gguf(open_gguf(FIXTURES / f"tiny_{request.param}.gguf"))
    assert model.config.architecture == request.param
    return model, np.load(FIXTURES / f"tiny_{request.param}.npz")


@pytest.mark.parametrize("seq", [0, 1])
def test_every_position_matches_hf_through_prefill_and_decode(tiny, seq):
    """Prefill the first token, then decode the rest one by one: each step's logits are HF's row."""
    model, ref = tiny
    ids, want = ref[f"ids_{seq}"].tolist(), ref[f"logits_{seq}"]
    cache = make_cache("prealloc", model.config.kv_geometry, len(ids))
    got = [model.prefill(np.array(ids[:1]), cache)]
    got += [model.decode(token, pos, cache) for pos, token in enumerate(ids[1:], start=1)]
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("seq", [0, 1])
def test_naive_forward_and_prefill_match_hf_on_the_last_position(tiny, seq):
    model, ref = tiny
    ids, want = ref[f"ids_{seq}"], ref[f"logits_{seq}"][-1]
    np.testing.assert_allclose(model.forward(ids), want, rtol=0, atol=TOLERANCE)
    cache = make_cache("basic", model.config.kv_geometry, len(ids))
    np.testing.assert_allclose(model.prefill(ids, cache), want, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("seq", [0, 1])
def test_greedy_continuation_matches_hf(tiny, seq):
    model, ref = tiny
    ids, want = ref[f"ids_{seq}"].tolist(), ref[f"continuation_{seq}"].tolist()
    cache = make_cache("prealloc", model.config.kv_geometry, len(ids) + len(want))
    logits = model.prefill(np.array(ids), cache)
    tokens = [int(np.argmax(logits))]
    while len(tokens) < len(want):
        tokens.append(int(np.argmax(model.decode(tokens[-1], cache.length, cache))))
    assert tokens == want
