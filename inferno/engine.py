"""A loaded model ready to run: weights, tokenizer, compiled kernels, and the cache it needs."""

from __future__ import annotations

import contextlib
import os
from time import perf_counter

import numpy as np

from inferno.config import ModelConfig
from inferno.errors import InfernoError
from inferno.gguf_file import open_gguf
from inferno.kv_cache import BasicKVCache, KVCache, create_kv_cache
from inferno.model import Transformer
from inferno.quant import MATMUL_MIN_ROWS
from inferno.snapshot import model_fingerprint
from inferno.tokenizer import GGUFTokenizer


class Engine:
    def __init__(
        self, model: Transformer, tokenizer: GGUFTokenizer, startup: dict[str, float], fingerprint: str
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.startup = startup  # load_ms, jit_ms
        self.fingerprint = fingerprint  # which model made a cache: snapshots are checked against it

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @classmethod
    def load(cls, path: str | os.PathLike, status=None) -> Engine:
        """Open the GGUF, map its weights, build its tokenizer and compile the kernels.

        status: a rich Console to show progress on (None for quiet, as with --json).
        """

        def step(message: str):
            return status.status(message) if status is not None else contextlib.nullcontext()

        t0 = perf_counter()
        with step(f"loading {path}"):
            model, tokenizer, fingerprint = _read(path)
        t1 = perf_counter()
        with step("compiling kernels (cached on disk after the first run)"):
            warm_up(model)
        t2 = perf_counter()
        startup = {"load_ms": (t1 - t0) * 1000, "jit_ms": (t2 - t1) * 1000}
        return cls(model, tokenizer, startup, fingerprint)

    def make_cache(
        self, mode: str | None, prompt_tokens: int, new_tokens: int, max_context: int | None = None
    ) -> KVCache | None:
        """The cache for a request, refusing before any work a request that cannot fit."""
        context = self.config.context_length
        needed = prompt_tokens + new_tokens
        if prompt_tokens == 0:
            raise InfernoError("the prompt is empty (0 tokens)")
        if prompt_tokens > context:
            raise InfernoError(
                f"prompt of {prompt_tokens} tokens is longer than the model's context of {context}"
            )
        if mode is None:
            if needed > context:
                raise InfernoError(
                    f"prompt of {prompt_tokens} tokens + {new_tokens} new tokens = {needed}, "
                    f"more than the model's context of {context}"
                )
            return None
        capacity = max_context or needed
        if capacity > context:
            raise InfernoError(f"--max-context {capacity} is more than the model's context of {context}")
        if needed > capacity:
            raise InfernoError(
                f"prompt of {prompt_tokens} tokens + {new_tokens} new tokens = {needed}, "
                f"more than --max-context {capacity}"
            )
        return create_kv_cache(mode, self.config, capacity)


def _read(path: str | os.PathLike) -> tuple[Transformer, GGUFTokenizer, str]:
    """Everything a run needs from the file. The reader (tens of MB of parsed metadata) is released
    on return, before the kernels are compiled, so it never adds to the process's peak memory."""
    reader = open_gguf(path)
    return Transformer.from_gguf(reader), GGUFTokenizer.from_gguf(reader), model_fingerprint(reader)


def warm_up(model: Transformer) -> None:
    """Run every kernel once so the first timed forward measures work, not compiling: a prompt just
    long enough to take prefill's BLAS path, then one decode step."""
    n = MATMUL_MIN_ROWS
    cache = BasicKVCache(model.config.n_layers, model.config.kv_width, n + 1)
    model.prefill(np.arange(n), cache)
    model.decode(n, n, cache)
