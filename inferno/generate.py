"""The generation loop: prefill once, then decode token by token, timing every forward."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from time import perf_counter

import numpy as np

from inferno.kv import KVCache
from inferno.metrics import Metrics
from inferno.model import Transformer
from inferno.sampling import Sampler
from inferno.validate import check_logits, refusing_non_finite


@dataclass
class Generation:
    """A generation as it goes: stream_generate yields this same object after every new token."""

    prompt_ids: list[int]
    token_ids: list[int]  # generated so far
    metrics: Metrics
    finish_reason: str | None = None  # set when it ends: "stop" or "length" (callers add "interrupted")
    logits: np.ndarray | None = None  # float32 [vocab]: what the last token was sampled from


def stream_generate(
    model: Transformer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampler: Sampler,
    cache: KVCache | None = None,
    is_stop: Callable[[int], bool] = lambda _: False,
) -> Iterator[Generation]:
    """Generate up to max_new_tokens after prompt_ids, yielding after each token; stop early when
    is_stop(token).

    With a cache, tokens it already holds (a loaded snapshot of this prompt's prefix) are not
    prefilled again. Without one, every step is a full forward over the whole sequence.
    """
    ids = list(prompt_ids)
    start = cache.length if cache is not None else 0
    metrics = Metrics(prompt_tokens=len(ids), prefilled_tokens=len(ids) - start,
                      activations=model.activations)
    if cache is not None:
        metrics.cache, metrics.cache_capacity = cache.kind, cache.capacity
        metrics.cache_dtype = cache.dtype.name
    generation = Generation(list(prompt_ids), [], metrics)

    def timed(forward: Callable[..., np.ndarray], *args) -> np.ndarray:
        t = perf_counter()
        with refusing_non_finite(len(ids) - 1):
            logits = forward(*args)
        metrics.per_forward_ms.append((perf_counter() - t) * 1000)
        if cache is not None:
            metrics.cache_bytes = cache.nbytes
            metrics.evicted_tokens = cache.evicted_tokens
        check_logits(logits, len(ids) - 1)
        return logits

    t0 = perf_counter()
    if cache is None:
        logits = timed(model.forward, np.array(ids))
    else:
        logits = timed(model.prefill, np.array(ids[start:]), cache)
    while True:
        generation.logits = logits
        token = sampler(logits)
        generation.token_ids.append(token)
        metrics.generated_tokens += 1
        now = perf_counter()
        if metrics.generated_tokens == 1:
            metrics.ttft_ms = (now - t0) * 1000
            first_out = now
        metrics.decode_ms = (now - first_out) * 1000
        if is_stop(token):
            generation.finish_reason = "stop"
        elif metrics.generated_tokens == max_new_tokens:
            generation.finish_reason = "length"
        yield generation
        if generation.finish_reason:
            return
        ids.append(token)
        if cache is None:
            logits = timed(model.forward, np.array(ids))
        else:
            logits = timed(model.decode, token, len(ids) - 1, cache)


def generate(
    model: Transformer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampler: Sampler,
    cache: KVCache | None = None,
    is_stop: Callable[[int], bool] = lambda _: False,
) -> Generation:
    """stream_generate run to the end."""
    *_, generation = stream_generate(model, prompt_ids, max_new_tokens, sampler, cache, is_stop)
    return generation
