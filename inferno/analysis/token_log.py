"""The per-token log: one record per forward, saying which token came out of it, how likely the model
found it (and its top alternatives), what the forward cost and how full the cache was after it.

It is what a user reads to see why a greedy run took the path it did, or where a quantized cache
first disagreed with the float one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inferno.kv import KVCache
from inferno.runtime.scheduler import Generation
from inferno.text.tokenizer import GGUFTokenizer

EOS_LINE = "[EOS reached]"


@dataclass(frozen=True)
class Alternative:
    token_id: int
    text: str
    prob: float


@dataclass(frozen=True)
class TokenRecord:
    step: int  # 1 for the first forward (the prefill)
    phase: str  # "prefill", "decode", or "full" (no cache: every forward runs the whole sequence)
    token_id: int
    text: str
    prob: float  # of token_id under softmax(logits) of this forward
    top: tuple[Alternative, ...]  # the K most likely tokens, most likely first
    forward_ms: float
    cache_length: int | None  # tokens the cache holds after this forward; None without a cache
    end_of_sequence: bool  # this token ended the generation: the model's end-of-sequence token

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "phase": self.phase,
            "token_id": self.token_id,
            "text": self.text,
            "prob": self.prob,
            "top": [{"token_id": a.token_id, "text": a.text, "prob": a.prob} for a in self.top],
            "forward_ms": self.forward_ms,
            "cache_length": self.cache_length,
            "end_of_sequence": self.end_of_sequence,
        }

    def line(self) -> str:
        """The record as one log line (text mode)."""
        cache = f"  cache {self.cache_length}" if self.cache_length is not None else ""
        line = (f"step {self.step:>4}  {self.phase:<7}  id {self.token_id:>6}  {self.text!r:<14} "
                f"p {100 * self.prob:6.2f}%  {self.forward_ms:7.2f} ms{cache}")
        if self.top:
            line += "  | " + "  ".join(f"{a.text!r} {100 * a.prob:.2f}%" for a in self.top)
        return line + (f"\n{EOS_LINE}" if self.end_of_sequence else "")


def probabilities(logits: np.ndarray) -> np.ndarray:
    """softmax of logits in float64: the model's next-token distribution."""
    z = logits.astype(np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


class TokenLog:
    """Builds a TokenRecord from the live Generation after each new token."""

    def __init__(self, tokenizer: GGUFTokenizer, cache: KVCache | None, top_k: int = 0):
        self.tokenizer = tokenizer
        self.cache = cache
        self.top_k = top_k
        self.records: list[TokenRecord] = []

    def add(self, generation: Generation) -> TokenRecord:
        probs = probabilities(generation.logits)
        token = generation.token_ids[-1]
        step = len(generation.token_ids)
        top = np.argsort(-probs, kind="stable")[: self.top_k]
        record = TokenRecord(
            step=step,
            phase="full" if self.cache is None else ("prefill" if step == 1 else "decode"),
            token_id=token,
            text=self.tokenizer.token_text(token),
            prob=float(probs[token]),
            top=tuple(Alternative(int(i), self.tokenizer.token_text(int(i)), float(probs[i])) for i in top),
            forward_ms=generation.metrics.per_forward_ms[-1],
            cache_length=None if self.cache is None else self.cache.length,
            end_of_sequence=generation.finish_reason == "stop" and self.tokenizer.is_stop(token),
        )
        self.records.append(record)
        return record
