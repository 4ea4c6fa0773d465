"""What a KV cache holds, as plain data: the cache a prompt fills, the tokens at its positions, the mean
L2 norm of K and V per layer and KV head, and the attention weights of a layer's last query.

Everything is read through the cache protocol (`read`, `head_rows`), so every kind can be inspected,
and a snapshot is inspected as the cache it was saved from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from inferno.kv import KVCache, make_cache
from inferno.snapshot import Snapshot

if TYPE_CHECKING:
    from inferno.engine import Engine  # loading it pulls in the model and its kernels

INSPECTED_KIND = "prealloc"


def fill_cache(
    engine: Engine, prompt_ids: Sequence[int], n_decode: int, max_context: int | None = None
) -> tuple[KVCache, list[int], list[np.ndarray]]:
    """Run the prompt and n_decode greedy tokens into a cache: (cache, token ids, queries).

    The last token goes through decode, which hands over each layer's query row after RoPE.
    """
    cache = engine.make_cache(INSPECTED_KIND, len(prompt_ids), n_decode, max_context)
    model, ids = engine.model, list(prompt_ids)
    if len(ids) > 1:
        model.prefill(np.array(ids[:-1]), cache)
    queries: list[np.ndarray] = []
    for step in range(n_decode + 1):
        last = step == n_decode
        logits = model.decode(ids[-1], len(ids) - 1, cache, queries=queries if last else None)
        if not last:
            ids.append(int(np.argmax(logits)))  # greedy
    return cache, ids, queries


def cache_of(snapshot: Snapshot) -> KVCache:
    """The snapshot's rows in a cache of its length, to be inspected like a live one."""
    cache = make_cache(INSPECTED_KIND, snapshot.geometry, snapshot.length)
    for layer in range(snapshot.geometry.layers):
        cache.write(layer, 0, snapshot.keys[layer], snapshot.values[layer])
    cache.commit(snapshot.length)
    return cache


def mean_norms(cache: KVCache) -> tuple[list[list[float]], list[list[float]]]:
    """Mean over the committed positions of each KV head's L2 norm, of K and of V: [layers][kv_heads]."""
    g = cache.geometry
    keys = [[0.0] * g.kv_heads for _ in range(g.layers)]
    values = [[0.0] * g.kv_heads for _ in range(g.layers)]
    for layer in range(g.layers):
        for head in range(g.kv_heads):
            k, v = cache.head_rows(layer, head, 0, cache.length)
            keys[layer][head] = float(np.linalg.norm(k.astype(np.float64), axis=1).mean())
            values[layer][head] = float(np.linalg.norm(v.astype(np.float64), axis=1).mean())
    return keys, values


def attention_weights(cache: KVCache, layer: int, query: np.ndarray) -> np.ndarray:
    """softmax(q . k / sqrt(head_dim)) of each query head over the committed positions: [heads, length].

    Query head h reads KV head h // group_size, as grouped-query attention does; a sliding-window
    layer sees only its last `window` positions (weight 0 before them).
    """
    g = cache.geometry
    keys, _ = cache.read(layer)
    window = g.window(layer)
    first = max(len(keys) - window, 0) if window else 0
    q = query.reshape(g.kv_heads, g.group_size, g.head_dim).astype(np.float64)
    k = keys[first:].reshape(-1, g.kv_heads, g.head_dim).astype(np.float64)
    scores = np.einsum("hgd,shd->hgs", q, k).reshape(g.heads, -1) / np.sqrt(g.head_dim)
    weights = np.zeros((g.heads, len(keys)))
    weights[:, first:] = np.exp(scores - scores.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True)


def build_report(
    cache: KVCache, token_ids: Sequence[int], architecture: str, fingerprint: str, texts: list[str] | None
) -> dict[str, Any]:
    """Everything kv-inspect shows about a cache's contents, as plain data (its --json output).

    token_ids: the token at each committed position; texts: the same tokens as text, when there is a
    tokenizer.
    """
    if len(token_ids) != cache.length:
        raise ValueError(f"{len(token_ids)} token ids for a cache of {cache.length} tokens")
    g = cache.geometry
    dtype = cache.read(0)[0].dtype
    tokens: list[dict[str, Any]] = [{"pos": pos, "id": int(token)} for pos, token in enumerate(token_ids)]
    if texts is not None:
        for token, text in zip(tokens, texts, strict=True):
            token["text"] = text
    key_norms, value_norms = mean_norms(cache)
    return {
        "architecture": architecture,
        "fingerprint": fingerprint,
        "layers": g.layers,
        "kv_heads": g.kv_heads,
        "heads": g.heads,
        "head_dim": g.head_dim,
        "kv_width": g.kv_width,
        "dtype": str(dtype),
        "k_after_rope": True,
        "length": cache.length,
        "capacity": cache.capacity,
        "bytes_per_token": g.nbytes(1, dtype.itemsize),
        "bytes_used": g.nbytes(cache.length, dtype.itemsize),
        "bytes_allocated": cache.nbytes,
        "tokens": tokens,
        "key_norms": key_norms,
        "value_norms": value_norms,
    }


def inspect_snapshot(snapshot: Snapshot) -> dict[str, Any]:
    """The report of a saved cache: token ids without text, as there is no tokenizer."""
    return build_report(cache_of(snapshot), snapshot.token_ids.tolist(), snapshot.architecture,
                        snapshot.fingerprint, None)


def inspect_prompt(
    engine: Engine, prompt_ids: Sequence[int], n_decode: int = 0, layer: int | None = None,
    max_context: int | None = None,
) -> dict[str, Any]:
    """The report of a cache filled with the prompt and n_decode greedy tokens; with `layer`, also the
    attention weights of that layer's last query."""
    cache, ids, queries = fill_cache(engine, prompt_ids, n_decode, max_context)
    texts = [engine.tokenizer.token_text(token_id) for token_id in ids]
    report = {"cache": cache.kind}
    report |= build_report(cache, ids, engine.config.architecture, engine.fingerprint, texts)
    if layer is not None:
        weights = attention_weights(cache, layer, queries[layer])
        report["attention"] = {"layer": layer, "query_pos": len(ids) - 1, "weights": weights.tolist()}
    return report
