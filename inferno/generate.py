"""The generation loop: prefill once, then decode token by token, timing every forward."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from inferno.kv_cache import KVCache
from inferno.model import Transformer
from inferno.sampling import Sampler


@dataclass
class Metrics:
    """What a run cost. per_forward_ms[0] is the prefill (or, with no cache, the first full forward)."""

    prompt_tokens: int
    prefilled_tokens: int  # fewer than prompt_tokens when a loaded cache already held the rest
    generated_tokens: int
    per_forward_ms: list[float] = field(default_factory=list)
    ttft_ms: float = 0.0
    decode_ms: float = 0.0  # from the first token out to the last
    cache: str | None = None
    cache_bytes: int = 0
    cache_capacity: int = 0

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / (self.per_forward_ms[0] / 1000)

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first."""
        steps = self.generated_tokens - 1
        return self.decode_ms / steps if steps else None

    @property
    def decode_tok_s(self) -> float | None:
        tpot = self.tpot_ms
        return 1000 / tpot if tpot else None

    def to_dict(self) -> dict:
        forwards = self.per_forward_ms
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_ms": self.ttft_ms,
            "prefill_ms": forwards[0],
            "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s": self.decode_tok_s,
            "tpot_ms": self.tpot_ms,
            "per_forward_ms": forwards,
            "forward_ms_min": min(forwards),
            "forward_ms_max": max(forwards),
            "forward_ms_mean": sum(forwards) / len(forwards),
            "cache": self.cache,
            "cache_bytes": self.cache_bytes,
            "cache_capacity": self.cache_capacity,
        }


@dataclass
class Generation:
    token_ids: list[int]
    metrics: Metrics


def generate(
    model: Transformer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampler: Sampler,
    cache: KVCache | None = None,
    is_stop: Callable[[int], bool] = lambda _: False,
    on_token: Callable[[int], None] = lambda _: None,
) -> Generation:
    """Generate up to max_new_tokens after prompt_ids; stop early when is_stop(token).

    With a cache, tokens it already holds (a loaded snapshot of this prompt's prefix) are not
    prefilled again. Without one, every step is a full forward over the whole sequence.
    """
    ids = list(prompt_ids)
    start = cache.length if cache is not None else 0
    metrics = Metrics(prompt_tokens=len(ids), prefilled_tokens=len(ids) - start, generated_tokens=0)

    def timed(forward: Callable[..., np.ndarray], *args) -> np.ndarray:
        t = perf_counter()
        logits = forward(*args)
        metrics.per_forward_ms.append((perf_counter() - t) * 1000)
        return logits

    t0 = perf_counter()
    if cache is None:
        logits = timed(model.forward, np.array(ids))
    else:
        logits = timed(model.prefill, np.array(ids[start:]), cache)
    generated: list[int] = []
    while True:
        token = sampler(logits)
        generated.append(token)
        now = perf_counter()
        if len(generated) == 1:
            metrics.ttft_ms = (now - t0) * 1000
            first_out = now
        metrics.decode_ms = (now - first_out) * 1000
        on_token(token)
        if is_stop(token) or len(generated) == max_new_tokens:
            break
        ids.append(token)
        if cache is None:
            logits = timed(model.forward, np.array(ids))
        else:
            logits = timed(model.decode, token, len(ids) - 1, cache)

    metrics.generated_tokens = len(generated)
    if cache is not None:
        metrics.cache, metrics.cache_bytes, metrics.cache_capacity = cache.kind, cache.nbytes, cache.capacity
    return Generation(generated, metrics)
