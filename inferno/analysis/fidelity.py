"""What a cache's element type costs in quality: one text teacher-forced through a float32 cache and
through caches of other element types, side by side, one decode step at a time.

At every position each cache's model predicts the next token of the text; against the float cache's
prediction we count top-1 agreement and the KL divergence KL(float || other) of the next-token
distributions, and each cache's perplexity on the text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from time import perf_counter

import numpy as np

from inferno.kv import KVCache, make_cache
from inferno.kv.dtypes import F32, element_type
from inferno.model.transformer import Transformer


def default_text() -> tuple[str, str]:
    """A long natural English text every Python ships, and where it comes from: the "Execution model"
    chapter of the Python Language Reference, in the standard library's pydoc_data."""
    import platform
    from pydoc_data.topics import topics

    source = f'Python {platform.python_version()} standard library, pydoc_data.topics["execmodel"]'
    return topics["execmodel"], source


@dataclass
class Fidelity:
    dtype: str
    activations: str  # how the matrix-vector products took activations (activation_parts.ACTIVATIONS)
    bits_per_value: float  # the cache's bytes over the values it was sized for (scales, open groups included)
    cache_bytes: int
    top1_agreement: float  # share of positions whose most likely next token is the float cache's
    kl_mean: float  # mean over positions of KL(float || this), in nats
    kl_max: float
    perplexity: float
    decode_ms: float  # mean decode step, all positions

    def to_json(self) -> dict:
        return asdict(self)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def measure(
    model: Transformer, token_ids: list[int], dtypes: list[str], layout: str = "prealloc",
    activations: str = "f32",
) -> list[Fidelity]:
    """Teacher-force token_ids through a float32 cache and one cache per element type in `dtypes`, in
    lockstep (so no distribution is kept past its step); the float cache's row comes first. The
    reference takes float32 activations; the other rows take `activations` (with "int8", an f32
    row shows what rounding the activations alone costs)."""
    names = [F32, *(d for d in dtypes if d != F32 or activations != "f32")]
    modes = ["f32", *[activations] * (len(names) - 1)]
    for name in names:
        element_type(name)
    geometry = model.config.kv_geometry
    caches: list[KVCache] = [make_cache(layout, geometry, len(token_ids), name) for name in names]
    n = len(token_ids) - 1
    nll = np.zeros(len(names))
    agree = np.zeros(len(names))
    kl_sum = np.zeros(len(names))
    kl_max = np.zeros(len(names))
    seconds = np.zeros(len(names))
    before = model.activations
    try:
        for pos in range(n):
            target = token_ids[pos + 1]
            reference = None
            for i, cache in enumerate(caches):
                model.set_activations(modes[i])
                t0 = perf_counter()
                logits = model.decode(token_ids[pos], pos, cache)
                seconds[i] += perf_counter() - t0
                logp = log_softmax(logits)
                nll[i] -= logp[target]
                if reference is None:
                    reference, best = logp, int(np.argmax(logp))
                kl = float(np.sum(np.exp(reference) * (reference - logp)))
                kl_sum[i] += kl
                kl_max[i] = max(kl_max[i], kl)
                agree[i] += int(np.argmax(logp)) == best
    finally:
        model.set_activations(before)
    return [
        Fidelity(
            dtype=name,
            activations=modes[i],
            bits_per_value=8 * cache.nbytes / (2 * geometry.layers * cache.capacity * geometry.kv_width),
            cache_bytes=cache.nbytes,
            top1_agreement=agree[i] / n,
            kl_mean=kl_sum[i] / n,
            kl_max=kl_max[i],
            perplexity=float(np.exp(nll[i] / n)),
            decode_ms=seconds[i] / n * 1000,
        )
        for i, (name, cache) in enumerate(zip(names, caches, strict=True))
    ]
