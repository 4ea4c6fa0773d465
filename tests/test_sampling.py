"""Sampling against its definition: softmax(logits / T), cut to the top k tokens or to the smallest set
of mass p, drawn from a seeded generator."""

from __future__ import annotations

import numpy as np
import pytest

from inferno.errors import InfernoError
from inferno.model.sampling import Sampler

LOGITS = np.log(np.array([0.05, 0.40, 0.10, 0.30, 0.15])).astype(np.float32)  # softmax(LOGITS) is this
DRAWS = 20_000


def frequencies(sampler: Sampler, logits: np.ndarray = LOGITS) -> np.ndarray:
    ids = [sampler(logits) for _ in range(DRAWS)]
    return np.bincount(ids, minlength=len(logits)) / DRAWS


def tolerance(p: np.ndarray) -> np.ndarray:
    """Five standard deviations of a frequency over DRAWS draws: a correct sampler fails ~1 in 10^6."""
    return 5 * np.sqrt(p * (1 - p) / DRAWS) + 1e-9


def expect(probabilities: list[float]) -> np.ndarray:
    p = np.array(probabilities)
    return p / p.sum()


def test_greedy_is_the_argmax():
    assert Sampler()(LOGITS) == 1 and Sampler(seed=5)(-LOGITS) == 0


def test_the_same_seed_gives_the_same_ids_and_another_seed_others():
    def draw(seed: int) -> list[int]:
        sampler = Sampler(temperature=1.0, seed=seed)
        return [sampler(LOGITS) for _ in range(50)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_frequencies_follow_the_softmax():
    want = expect([0.05, 0.40, 0.10, 0.30, 0.15])
    got = frequencies(Sampler(temperature=1.0, seed=0))
    assert np.all(np.abs(got - want) < tolerance(want)), (got, want)


def test_temperature_sharpens_the_distribution():
    want = expect([0.05**2, 0.40**2, 0.10**2, 0.30**2, 0.15**2])  # T = 0.5 squares the probabilities
    got = frequencies(Sampler(temperature=0.5, seed=1))
    assert np.all(np.abs(got - want) < tolerance(want)), (got, want)


def test_top_k_keeps_the_k_most_likely():
    want = expect([0, 0.40, 0, 0.30, 0])
    got = frequencies(Sampler(temperature=1.0, top_k=2, seed=2))
    assert got[[0, 2, 4]].sum() == 0
    assert np.all(np.abs(got - want) < tolerance(want)), (got, want)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # Sorted: 0.40, 0.30, 0.15, ... ; 0.40 + 0.30 = 0.70 < 0.75, so the third token is needed too.
    want = expect([0, 0.40, 0, 0.30, 0.15])
    got = frequencies(Sampler(temperature=1.0, top_p=0.75, seed=3))
    assert got[[0, 2]].sum() == 0
    assert np.all(np.abs(got - want) < tolerance(want)), (got, want)


def test_a_tiny_top_p_still_keeps_one_token():
    assert frequencies(Sampler(temperature=1.0, top_p=0.01, seed=4))[1] == 1.0


@pytest.mark.parametrize(
    "options, fragment",
    [({"temperature": -0.1}, "--temperature"), ({"top_k": -1}, "--top-k"), ({"top_p": 0.0}, "--top-p"),
     ({"top_p": 1.1}, "--top-p")],
)
def test_bad_settings_are_refused(options, fragment):
    with pytest.raises(InfernoError, match=fragment):
        Sampler(**options)
