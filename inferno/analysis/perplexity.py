"""Teacher-forced scoring of a text through a KV cache: how well a cache layout keeps what the model
needs, as the perplexity of the text."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inferno.kv import KVCache
from inferno.model.transformer import PREFILL_CHUNK, Transformer


def token_nll(
    model: Transformer, ids: Sequence[int], cache: KVCache, chunk: int = PREFILL_CHUNK
) -> np.ndarray:
    """-log p(ids[t + 1] | ids[..t]) for every t, the text fed through `cache` `chunk` tokens at a time
    (so only one chunk's logits are ever held). float64 [len(ids) - 1]."""
    ids = np.asarray(ids)
    scored = []
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : min(start + chunk, len(ids) - 1)]
        logits = model.prefill(piece, cache, every_logit=True).astype(np.float64)
        targets = ids[start + 1 : start + 1 + len(piece)]
        top = logits.max(axis=1)
        log_z = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        scored.append(log_z - logits[np.arange(len(piece)), targets])
    return np.concatenate(scored)


def perplexity(nll: np.ndarray) -> float:
    return float(np.exp(nll.mean()))
