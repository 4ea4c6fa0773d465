"""What a KV cache holds, as plain data: the cache a prompt fills, the tokens at its positions, the mean
L2 norm of K and V per layer and KV head, and the attention weights of a layer's last query; for a
paged cache, how its sequences sit in the block pool (block tables, reference counts, fragmentation).

Everything is read through the cache protocol (`read`, `head_rows`), so every layout can be inspected,
and a snapshot is inspected as the cache it was saved from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from inferno.errors import InfernoError
from inferno.kv import DEFAULT_DTYPE, KVCache, KVGeometry, make_cache
from inferno.kv.paged import PagedKVCache
from inferno.kv.pool import BLOCK_SIZE, BlockPool, blocks_for, layer_groups
from inferno.kv.snapshot import Snapshot
from inferno.model.validate import check_logits, refusing_non_finite

if TYPE_CHECKING:
    from inferno.runtime.engine import Engine  # loading it pulls in the model and its kernels

INSPECTED_LAYOUT = "prealloc"


def fill_cache(
    engine: Engine, prompt_ids: Sequence[int], n_decode: int, max_context: int | None = None,
    layout: str = INSPECTED_LAYOUT, **options,
) -> tuple[KVCache, list[int], list[np.ndarray]]:
    """Run the prompt and n_decode greedy tokens into a cache of `layout` (options: the layout's own):
    (cache, token ids, queries).

    The last token goes through decode, which hands over each layer's query row after RoPE.
    """
    cache = engine.make_cache(layout, len(prompt_ids), n_decode, max_context, **options)
    model, ids = engine.model, list(prompt_ids)
    with refusing_non_finite(len(ids) - 1):
        if len(ids) > 1:
            model.prefill(np.array(ids[:-1]), cache)
    queries: list[np.ndarray] = []
    for step in range(n_decode + 1):
        last = step == n_decode
        with refusing_non_finite(len(ids) - 1):
            logits = model.decode(ids[-1], len(ids) - 1, cache, queries=queries if last else None)
        check_logits(logits, len(ids) - 1)
        if not last:
            ids.append(int(np.argmax(logits)))  # greedy
    return cache, ids, queries


def fill_paged(
    engine: Engine, prompt_ids: Sequence[int], n_decode: int, samples: int, block_size: int = BLOCK_SIZE,
    max_context: int | None = None, **options,
) -> tuple[list[PagedKVCache], list[int], list[np.ndarray]]:
    """The prompt into one paged sequence, forked into `samples` sequences sharing its blocks, which
    decode n_decode greedy tokens together: (the sequences, sequence 0's token ids, its queries).

    The prompt's last token is decoded by each fork, so a shared partial block is copied on write
    as it is when model-generate --num-samples runs; greedy sequences hold the same tokens.
    """
    # refused before any work if it cannot fit
    capacity = engine.make_cache("paged", len(prompt_ids), n_decode, max_context, block_size=block_size,
                                 **options).capacity
    model, ids = engine.model, list(prompt_ids)
    shared = len(ids) - 1  # the forks share the prompt before its last token
    pool = samples_pool(engine.config.kv_geometry, shared, capacity - shared, samples, block_size)
    first = PagedKVCache(pool.geometry, capacity, pool=pool)
    with refusing_non_finite(shared):
        if shared:
            model.prefill(np.array(ids[:-1]), first)
    caches = [first] + [first.fork() for _ in range(samples - 1)]
    queries: list[np.ndarray] = []
    for _ in range(n_decode):
        with refusing_non_finite(len(ids) - 1):
            logits = model.decode_batch([ids[-1]] * samples, caches)
        check_logits(logits[0], len(ids) - 1)
        ids.append(int(np.argmax(logits[0])))  # greedy: every sequence takes the same token
    with refusing_non_finite(len(ids) - 1):
        model.decode(ids[-1], len(ids) - 1, first, queries=queries)
        if samples > 1:
            model.decode_batch([ids[-1]] * (samples - 1), caches[1:])
    return caches, ids, queries


def samples_pool(
    geometry: KVGeometry, prompt_tokens: int, new_tokens: int, n: int, block_size: int
) -> BlockPool:
    """N forks of one prompt: its full blocks once, then each sample's own blocks (its copy of the
    partial last block and what it generates), in every layer group."""
    shared = prompt_tokens // block_size
    own = blocks_for(prompt_tokens + new_tokens, block_size) - shared
    return BlockPool(geometry, len(layer_groups(geometry)) * (shared + n * own), block_size)


def pool_map(caches: Sequence[PagedKVCache]) -> dict[str, Any]:
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
    geometry = replace(snapshot.geometry, windows=())  # rows as saved, read whole
    cache = make_cache(INSPECTED_LAYOUT, geometry, snapshot.length, snapshot.dtype)
    for layer in range(snapshot.geometry.layers):
        cache.write_stored(layer, 0, snapshot.keys[layer], snapshot.values[layer])
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
    keys, _ = cache.read(layer)
    window = cache.geometry.window(layer)
    return softmax_weights(query, keys, cache.geometry, max(len(keys) - window, 0) if window else 0)


def softmax_weights(query: np.ndarray, keys: np.ndarray, g: KVGeometry, first: int = 0) -> np.ndarray:
    """Attention weights [heads, len(keys)] of one query over keys[first:], 0 on the keys before."""
    q = query.reshape(g.kv_heads, g.group_size, g.head_dim).astype(np.float64)
    k = keys[first:].reshape(-1, g.kv_heads, g.head_dim).astype(np.float64)
    scores = np.einsum("hgd,shd->hgs", q, k).reshape(g.heads, -1) / np.sqrt(g.head_dim)
    weights = np.zeros((g.heads, len(keys)))
    weights[:, first:] = np.exp(scores - scores.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True)


def build_report(
    cache: KVCache, token_ids: Sequence[int], architecture: str, fingerprint: str, texts: list[str] | None,
    positions: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Everything kv-inspect shows about a cache's contents, as plain data (its --json output).

    token_ids: the token at each committed position; texts: the same tokens as text, when there is a
    tokenizer; positions: of the cache's rows, when they are not 0.. (what a window cache holds).
    """
    if len(token_ids) != cache.length:
        raise ValueError(f"{len(token_ids)} token ids for a cache of {cache.length} tokens")
    g = cache.geometry
    dtype = cache.dtype
    positions = range(cache.length) if positions is None else positions
    tokens: list[dict[str, Any]] = [
        {"pos": int(pos), "id": int(token)} for pos, token in zip(positions, token_ids, strict=True)
    ]
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
        "dtype": dtype.name,
        "k_after_rope": True,
        "length": cache.length,
        "capacity": cache.capacity,
        "bytes_per_token": dtype.nbytes(g, 1),
        "bytes_used": dtype.nbytes(g, cache.length),
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
    max_context: int | None = None, layout: str = INSPECTED_LAYOUT, dtype: str = DEFAULT_DTYPE,
    samples: int = 1,
    **options,
) -> dict[str, Any]:
    """The report of a cache of `layout` filled with the prompt and n_decode greedy tokens; with `layer`,
    also the attention weights of that layer's last query. With `dtype`, the float rows are stored in
    that element type and the report says what it loses (`key_error`, `value_error`). A paged cache is
    forked into `samples` sequences and the report adds their pool's block map; its contents are
    sequence 0's."""
    block_map: dict[str, Any] = {}
    if layout == "paged":
        caches, ids, queries = fill_paged(engine, prompt_ids, n_decode, samples,
                                          options.pop("block_size", BLOCK_SIZE), max_context, **options)
        cache, block_map = caches[0], pool_map(caches)
    elif samples != 1:
        raise InfernoError(f"more than one sequence needs a paged cache, not {layout}")
    else:
        cache, ids, queries = fill_cache(engine, prompt_ids, n_decode, max_context, layout, **options)
    errors = None
    if dtype != DEFAULT_DTYPE:
        cache, *errors = requantized(cache, dtype)
    if cache.evicts:
        held, view = held_view(cache)
    else:
        held, view = list(range(cache.length)), cache
    texts = [engine.tokenizer.token_text(ids[pos]) for pos in held]
    report = {"cache": cache.layout}
    report |= build_report(view, [ids[pos] for pos in held], engine.config.architecture, engine.fingerprint,
                           texts, held) | block_map
    if errors is not None:
        report["key_error"], report["value_error"] = errors
    if cache.evicts:
        report |= {"length": cache.length, "bytes_allocated": cache.nbytes, "window": window_report(cache)}
    if layer is not None:
        if cache.evicts:
            weights = softmax_weights(queries[layer], cache.attended_keys(layer), cache.geometry)
        else:
            weights = attention_weights(cache, layer, queries[layer])
        report["attention"] = {"layer": layer, "query_pos": len(ids) - 1, "weights": weights.tolist()}
    return report


def requantized(cache: KVCache, dtype: str) -> tuple[KVCache, list[list[float]], list[list[float]]]:
    """The float cache's committed rows stored as `dtype` in a prealloc cache, and what that loses:
    the relative RMS error ||stored - float|| / ||float|| of K and of V, per layer and KV head."""
    if cache.evicts:
        raise InfernoError("kv-inspect stores a window cache's rows as float32 only")
    g = cache.geometry
    stored = make_cache(INSPECTED_LAYOUT, g, cache.capacity, dtype)
    errors: tuple[list, list] = ([], [])
    for layer in range(g.layers):
        keys, values = cache.read(layer)
        stored.write(layer, 0, keys, values)
        for exact, rows, out in zip((keys, values), stored.read(layer, cache.length), errors, strict=True):
            heads = exact.reshape(-1, g.kv_heads, g.head_dim).astype(np.float64)
            diff = rows.reshape(heads.shape) - heads
            out.append(np.sqrt((diff**2).sum(axis=(0, 2)) / (heads**2).sum(axis=(0, 2))).tolist())
    stored.commit(cache.length)
    return stored, *errors


def held_view(cache: KVCache) -> tuple[list[int], KVCache]:
    """The positions a window cache holds, and their rows in a plain cache to be reported like one."""
    rows = [cache.held_rows(layer) for layer in range(cache.n_layers)]
    held = rows[0][0]
    if any(not np.array_equal(at, held) for at, _, _ in rows):
        raise InfernoError("kv-inspect shows window caches whose layers all hold the same positions")
    view = make_cache(INSPECTED_LAYOUT, replace(cache.geometry, windows=()), max(len(held), 1))
    for layer, (_, keys, values) in enumerate(rows):
        view.write(layer, 0, keys, values)
    view.commit(len(held))
    return held.tolist(), view


def window_report(cache: KVCache) -> dict[str, Any]:
    """Which positions a window cache holds and how full it is."""
    held = cache.held_positions(0, cache.length)
    sinks = [int(p) for p in held if p < cache.sinks]
    rest = [int(p) for p in held if p >= cache.sinks]
    return {"window": cache.geometry.window(0), "sinks": cache.sinks, "positions": cache.positions,
            "sink_positions": sinks, "window_positions": [rest[0], rest[-1]] if rest else [],
            "held": len(held), "rows": cache.rows[0], "evicted_tokens": cache.evicted_tokens}
