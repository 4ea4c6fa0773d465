"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from inferno.errors import InfernoError

# Below this, logits / temperature can overflow float64 (float32 logits reach 3.4e38); any temperature
# this small already samples the argmax.
MIN_TEMPERATURE = 1e-6


@dataclass
class Sampler:
    """temperature 0 means greedy (argmax); otherwise sample from the filtered, tempered softmax."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):  # an int past a float's range (10**400) never divides logits
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 1e300:
                raise InfernoError(f"--{name.replace('_', '-')} is past what a float holds")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise InfernoError(f"--temperature must be 0 (greedy) or from {MIN_TEMPERATURE} up, "
                               f"got {self.temperature}")
        if self.seed is not None and self.seed < 0:
            raise InfernoError(f"--seed must be 0 or more, got {self.seed}")
        if self.top_k < 0:
            raise InfernoError(f"--top-k must be 0 (off) or more, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InfernoError(f"--top-p must be in (0, 1], got {self.top_p}")
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.temperature == 0.0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / self.temperature
        order = np.argsort(-scaled, kind="stable")
        if self.top_k:
            order = order[: self.top_k]
        probs = np.exp(scaled[order] - scaled[order[0]])
        probs /= probs.sum()
        if self.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            keep = int(np.searchsorted(np.cumsum(probs), self.top_p)) + 1
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return int(order[self.rng.choice(len(order), p=probs)])
