"""Many sequences with one model load, decoded together in one block pool: N samples of one prompt
(nanochat's multi-sample: the prompt prefilled once, its blocks shared) and a batch of prompts (full
blocks of a common prefix reused through the pool's prefix index). Up to `max_batch` sequences advance
per step (`Transformer.decode_batch`); a finished one leaves and the next request takes its place.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from inferno.kv import KVGeometry
from inferno.kv.paged import BlockPool, PagedKVCache, blocks_for
from inferno.model import Transformer
from inferno.sampling import Sampler

# start(index, request) -> (the request's cache holding its prompt, the prompt's last logits, tokens reused)
Start = Callable[[int, "Request"], tuple[PagedKVCache, np.ndarray, int]]


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    sampler: Sampler
    is_stop: Callable[[int], bool] = lambda _: False


@dataclass
class Completion:
    """What one request produced and what it cost."""

    prompt_ids: list[int]
    reused_tokens: int  # of the prompt, found in the pool instead of prefilled
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prefill_ms: float = 0.0
    first_token_s: float = 0.0  # perf_counter of its first and last tokens
    last_token_s: float = 0.0

    @property
    def decode_tok_s(self) -> float | None:
        """Its tokens after the first over the time they took (shared with the batch it ran in)."""
        seconds = self.last_token_s - self.first_token_s
        return (len(self.token_ids) - 1) / seconds if seconds > 0 else None

    def to_json(self) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "reused_tokens": self.reused_tokens,
                "prefill_ms": self.prefill_ms, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "decode_tok_s": self.decode_tok_s}


@dataclass
class BatchRun:
    completions: list[Completion]
    pool: BlockPool
    wall_ms: float = 0.0  # from the first prefill to the last token
    decode_ms: float = 0.0  # in decode_batch steps
    decode_tokens: int = 0  # tokens those steps produced
    steps: int = 0
    peak_cache_bytes: int = 0  # of blocks held, a shared block counted once
    start_cache_bytes: int = 0  # held when the first decode step began (N samples: the prompt, once)
    activations: str = "f32"  # how the model's matrix-vector products took activations

    @property
    def decode_tok_s(self) -> float | None:
        """Aggregate: tokens of every sequence per second of batched decoding."""
        return self.decode_tokens / (self.decode_ms / 1000) if self.decode_ms else None

    def to_json(self) -> dict:
        return {"wall_ms": self.wall_ms, "decode_ms": self.decode_ms, "decode_tokens": self.decode_tokens,
                "decode_steps": self.steps, "decode_tok_s": self.decode_tok_s,
                "mean_batch": self.decode_tokens / self.steps if self.steps else None,
                "start_cache_bytes": self.start_cache_bytes,
                "peak_cache_bytes": self.peak_cache_bytes, "pool_bytes": self.pool.nbytes,
                "block_size": self.pool.block_size,
                "reused_tokens": sum(c.reused_tokens for c in self.completions),
                "prompt_tokens": sum(len(c.prompt_ids) for c in self.completions),
                "activations": self.activations}


def pool_for(geometry: KVGeometry, requests: Sequence[Request], max_batch: int, block_size: int) -> BlockPool:
    """A pool that can never run out: the blocks of the `max_batch` largest requests held unshared."""
    need = [blocks_for(len(r.prompt_ids) + r.max_new_tokens, block_size) for r in requests]
    return BlockPool(geometry, sum(sorted(need, reverse=True)[:max_batch]), block_size)


def run(model: Transformer, requests: Sequence[Request], pool: BlockPool, start: Start, max_batch: int,
        on_token: Callable[[int, Completion], None] | None = None) -> BatchRun:
    """Generate every request, up to max_batch at a time; on_token(index, completion) after each token."""
    result = BatchRun([None] * len(requests), pool, activations=model.activations)  # type: ignore[list-item]
    queue = deque(enumerate(requests))
    live: list[tuple[int, Request, PagedKVCache, Completion]] = []
    t0 = perf_counter()

    def take(index: int, request: Request, cache: PagedKVCache, done: Completion, logits: np.ndarray) -> bool:
        """Sample the next token; True while the sequence goes on."""
        token = request.sampler(logits)
        done.token_ids.append(token)
        done.last_token_s = perf_counter()
        if request.is_stop(token):
            done.finish_reason = "stop"
        elif len(done.token_ids) == request.max_new_tokens:
            done.finish_reason = "length"
        if on_token:
            on_token(index, done)
        result.peak_cache_bytes = max(result.peak_cache_bytes, pool.used_nbytes)
        if done.finish_reason:
            cache.reset()  # its blocks go back to the pool; published ones stay findable
            return False
        return True

    while queue or live:
        while queue and len(live) < max_batch:
            index, request = queue.popleft()
            t = perf_counter()
            cache, logits, reused = start(index, request)
            done = result.completions[index] = Completion(list(request.prompt_ids), reused)
            done.prefill_ms = (perf_counter() - t) * 1000
            done.first_token_s = perf_counter()
            if take(index, request, cache, done, logits):
                live.append((index, request, cache, done))
        if not live:
            continue
        if not result.steps:
            result.start_cache_bytes = pool.used_nbytes
        t = perf_counter()
        logits = model.decode_batch([done.token_ids[-1] for *_, done in live], [c for _, _, c, _ in live])
        result.decode_ms += (perf_counter() - t) * 1000
        result.decode_tokens += len(live)
        result.steps += 1
        live = [seq for seq, row in zip(live, logits, strict=True) if take(*seq, row)]
    result.wall_ms = (perf_counter() - t0) * 1000
    return result


def prefix_start(model: Transformer, pool: BlockPool) -> Start:
    """Each prompt in its own sequence, its leading full blocks adopted from the pool when some earlier
    prompt published them, the rest prefilled and published in turn (vLLM's automatic prefix caching)."""

    def start(_index: int, request: Request) -> tuple[PagedKVCache, np.ndarray, int]:
        ids = request.prompt_ids
        cache = PagedKVCache(pool.geometry, len(ids) + request.max_new_tokens, pool=pool)
        reused = cache.reuse_prefix(ids)
        logits = model.prefill(np.array(ids[reused:]), cache)
        cache.publish(ids)
        return cache, logits, reused

    return start


def samples_start(model: Transformer, pool: BlockPool) -> Start:
    """The first request's prompt is prefilled once; every later request (the same prompt) forks that
    sequence, sharing its blocks. All must start before the first decode step (max_batch >= N)."""
    first: list[tuple[PagedKVCache, np.ndarray]] = []

    def start(_index: int, request: Request) -> tuple[PagedKVCache, np.ndarray, int]:
        if not first:
            ids = request.prompt_ids
            cache = PagedKVCache(pool.geometry, len(ids) + request.max_new_tokens, pool=pool)
            first.append((cache, model.prefill(np.array(ids), cache)))
            return (*first[0], 0)
        parent, logits = first[0]
        return parent.fork(), logits, len(request.prompt_ids)

    return start


def samples_pool(
    geometry: KVGeometry, prompt_tokens: int, new_tokens: int, n: int, block_size: int
) -> BlockPool:
    """N forks of one prompt: its full blocks once, then each sample's own blocks (its copy of the
    partial last block and what it generates)."""
    shared = prompt_tokens // block_size
    own = blocks_for(prompt_tokens + new_tokens, block_size) - shared
    return BlockPool(geometry, shared + n * own, block_size)
