"""What a run cost and produced, as typed records: the text view renders them and `--json` serialises
them (`RunRecord.to_json`), so the two can never disagree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inferno.analysis.token_log import TokenRecord

SCHEMA_VERSION = 1  # of RunRecord.to_json(); bumped when a key changes meaning or goes away


@dataclass(frozen=True)
class Startup:
    """What came before the first forward, part by part (wall milliseconds)."""

    load_ms: float  # reading the model: open + weights + tokenizer + cache_write below
    jit_ms: float  # compiling (first run) or loading (later runs) the kernels, and running each once
    open_ms: float = 0.0  # parsing the GGUF's header and metadata, or mapping the prepared-model cache entry
    weights_ms: float = 0.0  # repacking the weights into tiles, or checking the cached tiles
    tokenizer_ms: float = 0.0  # building the tokenizer from the metadata, or from the cache
    cache_write_ms: float = 0.0  # writing the prepared-model cache entry (on a miss)
    model_cache: str = "off"  # "hit", "miss" (built from the file and written) or "off" (not written)
    model_cache_bytes: int = 0  # the prepared-model cache entry's size on disk (0: none)
    imports_ms: float | None = None  # the command's imports and argument checks, before loading

    def to_json(self) -> dict:
        return {"imports_ms": self.imports_ms, "open_ms": self.open_ms, "weights_ms": self.weights_ms,
                "tokenizer_ms": self.tokenizer_ms, "cache_write_ms": self.cache_write_ms,
                "kernels_ms": self.jit_ms, "model_cache": self.model_cache,
                "model_cache_bytes": self.model_cache_bytes}


@dataclass
class Metrics:
    """Per-forward timings of one request. per_forward_ms[0] is the prefill (all its chunks; with no
    cache, the first full forward); the others are the decode steps it took part in."""

    prompt_tokens: int
    prefilled_tokens: int  # fewer than prompt_tokens when a loaded cache or the prefix cache held the rest
    reused_tokens: int = 0  # of the prompt, found in the paged pool's prefix cache
    generated_tokens: int = 0
    per_forward_ms: list[float] = field(default_factory=list)
    ttft_ms: float = 0.0
    decode_ms: float = 0.0  # from the first token out to the last
    cache: str | None = None  # the cache layout, None without a cache
    cache_dtype: str | None = None  # the element type of its rows
    activations: str = "f32"  # how the matrix-vector products took activations (activation_parts.ACTIVATIONS)
    cache_bytes: int = 0
    cache_capacity: int = 0
    evicted_tokens: int = 0  # positions a window cache no longer holds (it evicts instead of refusing)
    threads: int = 0  # the kernels' threads in its last step (runtime.threads chooses them; 0: no step yet)

    @property
    def prefill_ms(self) -> float | None:
        return self.per_forward_ms[0] if self.per_forward_ms else None

    @property
    def prefill_tok_s(self) -> float | None:
        ms = self.prefill_ms
        return self.prefilled_tokens / (ms / 1000) if ms else None

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first."""
        steps = self.generated_tokens - 1
        return self.decode_ms / steps if steps > 0 else None

    @property
    def decode_tok_s(self) -> float | None:
        tpot = self.tpot_ms
        return 1000 / tpot if tpot else None

    def to_json(self) -> dict:
        forwards = self.per_forward_ms
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "reused_tokens": self.reused_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_ms": self.ttft_ms,
            "prefill_ms": self.prefill_ms,
            "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s": self.decode_tok_s,
            "tpot_ms": self.tpot_ms,
            "per_forward_ms": forwards,
            "forward_ms_min": min(forwards, default=None),
            "forward_ms_max": max(forwards, default=None),
            "forward_ms_mean": sum(forwards) / len(forwards) if forwards else None,
            "cache": self.cache,
            "cache_dtype": self.cache_dtype,
            "activations": self.activations,
            "cache_bytes": self.cache_bytes,
            "cache_capacity": self.cache_capacity,
            "evicted_tokens": self.evicted_tokens,
            "threads": self.threads,
        }


@dataclass
class RunRecord:
    """One model-generate run: everything its text view shows and its `--json` prints."""

    model: str
    prompt: str  # the text given to the tokenizer (after the chat template, with --chat)
    prompt_ids: list[int]
    token_ids: list[int]  # generated only, without the stop token that ended it
    text: str  # of token_ids, cut where a stop string begins
    finish_reason: str | None  # "stop" (a stop token or string), "length" (max tokens), "interrupted"
    metrics: Metrics
    startup: Startup
    wall_ms: float  # generating, from the prompt's first forward to the last token
    load_cache_ms: float | None = None  # reading a --load-cache snapshot
    token_log: list[TokenRecord] | None = None  # with --log-tokens
    stopped_by: str | None = None  # the stop string, or stop token's text, that ended it (not in text)

    def to_json(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "prompt": self.prompt,
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            **({"token_log": [r.to_json() for r in self.token_log]} if self.token_log is not None else {}),
            "stopped_by": self.stopped_by,
            "metrics": self.metrics.to_json()
            | {"wall_ms": self.wall_ms, "load_cache_ms": self.load_cache_ms,
               "load_ms": self.startup.load_ms, "jit_ms": self.startup.jit_ms,
               "startup": self.startup.to_json()},
        }
