"""Gemma 3 270M against HF transformers' float32 forward of the same GGUF (the reference fixtures).

The fixtures come from tests/reference/make_gemma_fixtures.py.

15 of its 18 layers see only the last 512 positions; the last prompt is longer than that, so both the
prefill mask and the decode window are checked against HF's own sliding-window attention. The tests
need neither torch nor transformers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FIXTURES, greedy

REFERENCE = json.loads((FIXTURES / "hf_gemma3.json").read_text())
ARRAYS = np.load(FIXTURES / "hf_gemma3.npz")
PROMPTS = REFERENCE["prompts"]
LONG = len(PROMPTS) - 1
N_NEW = REFERENCE["n_new"]
LOGIT_TOLERANCE = 1e-3  # measured: 4.4e-5 at most, on logits up to 32
NAIVE_STEPS = 3  # steps of the no-cache path on the long prompt: each reruns ~700 tokens


def prompt_ids(i: int) -> list[int]:
    return ARRAYS[f"prompt_ids_{i}"].tolist()


def test_every_sixth_layer_is_global_and_the_rest_see_512_positions(gemma_engine):
    config = gemma_engine.config
    assert REFERENCE["global_layers"] == [5, 11, 17]
    assert config.layer_windows == tuple(None if i in (5, 11, 17) else 512 for i in range(18))
    assert config.layer_rope_bases == tuple(1e6 if i in (5, 11, 17) else 1e4 for i in range(18))
    assert (config.n_heads, config.n_kv_heads, config.head_dim, config.hidden_size) == (4, 1, 256, 640)


def test_fixture_has_a_prompt_past_the_window():
    assert PROMPTS[LONG]["n_tokens"] > REFERENCE["sliding_window"] + 64


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_prompt_tokenizes_like_hf(gemma_engine, i):
    assert gemma_engine.tokenizer.encode(PROMPTS[i]["text"]) == prompt_ids(i)


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_greedy_continuation_and_logits_match_hf(gemma_engine, i):
    tokens, logits = greedy(gemma_engine, prompt_ids(i), N_NEW)
    assert tokens == ARRAYS[f"continuation_ids_{i}"].tolist()
    sampled = ARRAYS["sampled_ids"]
    np.testing.assert_allclose(
        logits[0][sampled], ARRAYS[f"prefill_sampled_logits_{i}"], rtol=0, atol=LOGIT_TOLERANCE
    )
    top_ids, top_logits = ARRAYS[f"step_topk_ids_{i}"], ARRAYS[f"step_topk_logits_{i}"]
    for step, row in enumerate(logits):
        np.testing.assert_allclose(row[top_ids[step]], top_logits[step], rtol=0, atol=LOGIT_TOLERANCE)


def test_no_cache_path_matches_the_cache_past_the_window(gemma_engine):
    """The naive path (whole sequence, prefill mask) and decode (last 512 rows of the cache) agree."""
    ids = prompt_ids(LONG)
    cached_tokens, cached_logits = greedy(gemma_engine, ids, NAIVE_STEPS)
    tokens = []
    for step in range(NAIVE_STEPS):
        logits = gemma_engine.model.forward(np.array(ids + tokens))
        np.testing.assert_allclose(logits, cached_logits[step], rtol=0, atol=1e-4, err_msg=f"step {step}")
        tokens.append(int(np.argmax(logits)))
    assert tokens == cached_tokens == ARRAYS[f"continuation_ids_{LONG}"][:NAIVE_STEPS].tolist()


@pytest.mark.parametrize("mode", ["basic", "prealloc"])
def test_cache_modes_agree_on_gemma(gemma_engine, mode):
    ids = prompt_ids(0)
    tokens, _ = greedy(gemma_engine, ids, 4, mode)
    assert tokens == ARRAYS["continuation_ids_0"][:4].tolist()


@pytest.mark.parametrize(("layer", "window"), [(0, 512), (5, None)])
def test_kv_inspect_local_layers_attend_only_to_their_window(gemma_engine, monkeypatch, layer, window):
    from inferno.cli.inspect import inspect_model
    from inferno.runtime.engine import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, path, progress=None: gemma_engine))
    report = inspect_model(gemma_engine, PROMPTS[LONG]["text"], 0, layer, None, None)
    weights = np.array(report["attention"]["weights"])
    assert weights.shape == (4, PROMPTS[LONG]["n_tokens"])
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=1e-6)
    outside = weights[:, : -window] if window else np.zeros(0)
    assert (outside == 0).all() and (weights[:, -(window or 1) :] > 0).all()
    assert window or (weights[:, 0] > 0.01).all()  # the global layer still reads the first token
