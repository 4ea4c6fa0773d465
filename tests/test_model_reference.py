"""SmolLM2-135M against HF transformers' float32 forward of the same GGUF (the reference fixtures).

The fixtures come from tests/reference/make_hf_fixtures.py; these tests need neither torch nor
transformers. Agreement asked: ids equal, greedy continuations token for token, logits within 1e-3.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FIXTURES, greedy

REFERENCE = json.loads((FIXTURES / "hf_smollm2.json").read_text())
LOGITS = np.load(FIXTURES / "hf_smollm2.npz")
PROMPTS = REFERENCE["prompts"]
LOGIT_TOLERANCE = 1e-3


def prompt_ids(i: int) -> list[int]:
    return LOGITS[f"prompt_ids_{i}"].tolist()


def test_fixture_has_a_long_prompt():
    assert max(len(prompt_ids(i)) for i in range(len(PROMPTS))) >= 400


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_prompt_tokenizes_like_hf(engine, i):
    assert engine.tokenizer.encode(PROMPTS[i]["text"]) == prompt_ids(i)


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_greedy_continuation_and_first_logits_match_hf(engine, i):
    tokens, logits = greedy(engine, prompt_ids(i), 32)
    assert tokens == LOGITS["continuation_ids"][i].tolist()
    np.testing.assert_allclose(logits[0], LOGITS["prefill_logits"][i], rtol=0, atol=LOGIT_TOLERANCE)


def test_decode_logits_match_hf(engine):
    _, logits = greedy(engine, prompt_ids(0), 1 + len(LOGITS["decode_logits_0"]))
    for step, want in enumerate(LOGITS["decode_logits_0"], start=1):
        np.testing.assert_allclose(logits[step], want, rtol=0, atol=LOGIT_TOLERANCE)


def test_long_greedy_continuation_matches_hf(engine):
    i = REFERENCE["long_continuation"]["prompt_index"]
    want = LOGITS["long_continuation_ids"].tolist()
    tokens, _ = greedy(engine, prompt_ids(i), len(want))
    assert tokens == want
