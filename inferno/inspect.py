"""What a KV cache holds, as plain data: the cache a prompt fills, the tokens at its positions, the mean
L2 norm of K and V per layer and KV head, and the attention weights of a layer's last query; for a
paged cache, how its sequences sit in the block pool (block tables, reference counts, fragmentation).

Everything is read through the cache protocol (`read`, `head_rows`), so every kind can be inspected,
and a snapshot is inspected as the cache it was saved from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from inferno.errors import InfernoError
from inferno.kv import KVCache, make_cache
from inferno.kv.paged import BLOCK_SIZE, PagedKVCache
from inferno.snapshot import Snapshot

if TYPE_CHECKING:
    from inferno.engine import Engine  # loading it pulls in the model and its kernels

INSPECTED_KIND = "prealloc"


def fill_cache(
    engine: Engine, prompt_ids: Sequence[int], n_decode: int, max_context: int | None = None,
    kind: str = INSPECTED_KIND,
) -> tuple[KVCache, list[int], list[np.ndarray]]:
    """Run the prompt and n_decode greedy tokens into a cache: (cache, token ids, queries).

    The last token goes through decode, which hands over each layer's query row after RoPE.
    """
    cache = engine.make_cache(kind, len(prompt_ids), n_decode, max_context)
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


def fill_paged(
    engine: Engine, prompt_ids: Sequence[int], n_decode: int, samples: int, block_size: int = BLOCK_SIZE,
    max_context: int | None = None,
) -> tuple[list[PagedKVCache], list[int], list[np.ndarray]]:
    """The prompt into one paged sequence, forked into `samples` sequences sharing its blocks, which
    decode n_decode greedy tokens together: (the sequences, sequence 0's token ids, its queries).

    The prompt's last token is decoded by each fork, so a shared partial block is copied on write
    as it is when model-generate --num-samples runs; greedy sequences hold the same tokens.
    """
    from inferno.batching import samples_pool

    sized = engine.make_cache("paged", len(prompt_ids), n_decode, max_context, block_size=block_size)
    capacity = sized.capacity  # refused before any work if it cannot fit
    model, ids = engine.model, list(prompt_ids)
    shared = len(ids) - 1  # the forks share the prompt before its last token
    pool = samples_pool(engine.config.kv_geometry, shared, capacity - shared, samples, block_size)
    first = PagedKVCache(pool.geometry, capacity, pool=pool)
    if len(ids) > 1:
        model.prefill(np.array(ids[:-1]), first)
    caches = [first] + [first.fork() for _ in range(samples - 1)]
    queries: list[np.ndarray] = []
    for _ in range(n_decode):
        logits = model.decode_batch([ids[-1]] * samples, caches)
        ids.append(int(np.argmax(logits[0])))  # greedy: every sequence takes the same token
    model.decode(ids[-1], len(ids) - 1, first, queries=queries)
    if samples > 1:
        model.decode_batch([ids[-1]] * (samples - 1), caches[1:])
    return caches, ids, queries


def pool_layout(caches: Sequence[PagedKVCache]) -> dict[str, Any]:
    """How paged sequences of one pool sit in it: each one's block table, every block's reference
    count, the free blocks, and slots allocated (held blocks x block size) against slots used
    (positions written in them, a shared block counted once)."""
    pool = caches[0].pool
    if any(cache.pool is not pool for cache in caches):
        raise ValueError("the sequences are in different block pools")
    bs = pool.block_size
    filled: dict[int, int] = {}  # held block -> rows written in it
    for cache in caches:
        for i, block in enumerate(cache.table):
            filled[block] = max(filled.get(block, 0), min(bs, max(cache.length - i * bs, 0)))
    refs = pool.refs.tolist()
    return {
        "block_size": bs,
        "pool_blocks": pool.n_blocks,
        "block_bytes": pool.block_nbytes,
        "blocks": [{"sequence": n, "length": c.length, "table": list(c.table)} for n, c in enumerate(caches)],
        "refcounts": refs,
        "shared_blocks": [block for block, count in enumerate(refs) if count > 1],
        "free_blocks": [block for block, count in enumerate(refs) if count == 0],
        "slots_allocated": len(filled) * bs,
        "slots_used": sum(filled.values()),
        "tokens_held": sum(c.length for c in caches),  # positions of every sequence: unshared, this many
        "bytes_held": pool.used_nbytes,
        "pool_bytes": pool.nbytes,
    }


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
    max_context: int | None = None, kind: str = INSPECTED_KIND, samples: int = 1,
    block_size: int = BLOCK_SIZE,
) -> dict[str, Any]:
    """The report of a cache filled with the prompt and n_decode greedy tokens; with `layer`, also the
    attention weights of that layer's last query. A paged cache (kind "paged") is forked into
    `samples` sequences and the report adds their pool layout; its contents are sequence 0's."""
    if kind == "paged":
        caches, ids, queries = fill_paged(engine, prompt_ids, n_decode, samples, block_size, max_context)
        cache, layout = caches[0], pool_layout(caches)
    else:
        if samples != 1 or block_size != BLOCK_SIZE:
            raise InfernoError(f"more than one sequence and block sizes need a paged cache, not {kind}")
        cache, ids, queries = fill_cache(engine, prompt_ids, n_decode, max_context, kind)
        layout = {}
    texts = [engine.tokenizer.token_text(token_id) for token_id in ids]
    report = {"cache": cache.kind}
    report |= build_report(cache, ids, engine.config.architecture, engine.fingerprint, texts) | layout
    if layer is not None:
        weights = attention_weights(cache, layer, queries[layer])
        report["attention"] = {"layer": layer, "query_pos": len(ids) - 1, "weights": weights.tolist()}
    return report
