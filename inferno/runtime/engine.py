"""A loaded model ready to run: weights, tokenizer, compiled kernels, the cache a request needs, and
the Python API the commands are thin users of:

    engine = inferno.runtime.engine.load("model.gguf")
    for piece in engine.stream("Once upon a time", max_new_tokens=32, kv="prealloc"):
        print(piece, end="")
    run = engine.generate("Once upon a time", 32)     # a RunRecord: text, ids, metrics
    scheduler = engine.scheduler(kv="paged", max_batch=8)   # many requests at once: inferno.runtime.scheduler
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from time import perf_counter

import numpy as np

from inferno import arguments
from inferno.errors import InfernoError
from inferno.file.config import ModelConfig
from inferno.kernels import attention
from inferno.kernels.quant import MATMUL_MIN_ROWS
from inferno.kv import DEFAULT_DTYPE, DTYPES, LAYOUTS, KVCache, cache_class, make_cache
from inferno.kv.paged import PagedKVCache
from inferno.kv.pool import BLOCK_SIZE, BlockPool
from inferno.model import prepared
from inferno.model.sampling import Sampler
from inferno.model.transformer import BATCH_ROWS, Transformer
from inferno.model.validate import check_logits, refusing_non_finite
from inferno.runtime.metrics import RunRecord, Startup
from inferno.runtime.scheduler import Generation, Request, Scheduler
from inferno.runtime.threads import GOVERNOR
from inferno.text.tokenizer import GGUFTokenizer

# progress("loading model.gguf") returns a context manager around that step (a spinner, a log line).
Progress = Callable[[str], AbstractContextManager]


class Engine:
    def __init__(self, model: Transformer, tokenizer: GGUFTokenizer, startup: Startup, fingerprint: str,
                 path: str = ""):
        self.model = model
        self.tokenizer = tokenizer
        self.startup = startup
        self.fingerprint = fingerprint  # which model made a cache: snapshots are checked against it
        self.path = path
        self._matmul_ready = False  # the BLAS path's kernels are loaded (see ready_for)
        # (layout, element type, activations) whose kernels are loaded: `load`'s warm-up ran the first
        self._caches_ready = {(WARM_LAYOUT, DEFAULT_DTYPE, model.activations)}

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @classmethod
    def load(cls, path: str | os.PathLike, progress: Progress | None = None) -> Engine:
        """Read the model (from the prepared-model cache when it holds this file), build its tokenizer
        and compile the kernels."""
        path = arguments.path("path", path)
        step = progress or (lambda _message: nullcontext())
        t0 = perf_counter()
        with step(f"loading {path}"):
            ready = prepared.load(path)
            release_freed_heap()
            reuse_freed_pages()
        t1 = perf_counter()
        GOVERNOR.settle()
        with step("compiling kernels (cached on disk after the first run)"):
            warm_up(ready.model)
        t2 = perf_counter()
        parts = {f"{name}_ms": ms for name, ms in ready.parts_ms.items()}
        startup = Startup(load_ms=(t1 - t0) * 1000, jit_ms=(t2 - t1) * 1000, model_cache=ready.cache,
                          model_cache_bytes=ready.cache_bytes, **parts)
        return cls(ready.model, ready.tokenizer, startup, ready.fingerprint, str(path))

    def make_cache(
        self, layout: str | None, prompt_tokens: int, new_tokens: int, max_context: int | None = None,
        dtype: str = DEFAULT_DTYPE, **options
    ) -> KVCache | None:
        """The cache for a request (None: no cache), refusing before any work a request that cannot fit;
        the kernels the request will use are then loaded (see `ready_for`).

        dtype: the element type of its rows (`inferno.kv.dtypes`); options: the layout's own (window:
        `window`, `sinks`, `positions`; paged: `block_size`). A layout that evicts holds what it can and
        runs past the model's context in its sliding layers; its global layers, if any, hold up to
        --max-context (default: the model's context).
        """
        arguments.choice("layout", layout, list(LAYOUTS), optional=True)
        arguments.count("prompt_tokens", prompt_tokens, 0)
        arguments.count("new_tokens", new_tokens, 0)
        arguments.optional_count("max_context", max_context)
        arguments.choice("dtype", dtype, list(DTYPES))
        cache = self._cache_for(layout, prompt_tokens, new_tokens, max_context, dtype, **options)
        self._ready_cache(cache, layout, dtype)
        # the most rows a forward of the request can take: the prompt, or with no cache the whole sequence
        self.ready_for(prompt_tokens + (new_tokens if layout is None else 0))
        return cache

    def _cache_for(
        self, layout: str | None, prompt_tokens: int, new_tokens: int, max_context: int | None,
        dtype: str, **options
    ) -> KVCache | None:
        context = self.config.context_length
        needed = prompt_tokens + new_tokens
        if prompt_tokens == 0:
            raise InfernoError("the prompt is empty (0 tokens)")
        if layout is not None and cache_class(layout).evicts:
            # a model with global layers keeps every position there: sized for the request, not the context
            mixed = None in self.config.kv_geometry.windows
            capacity = max_context or (min(needed, context) if mixed else context)
            if capacity > context:
                raise InfernoError(
                    f"a cache of {capacity} tokens is more than the model's context of {context}"
                )
            rotary = self.model.layer_rotary
            cache = make_cache(layout, self.config.kv_geometry, capacity, dtype, rotary=rotary, **options)
            if None in cache.geometry.windows and needed > capacity:
                raise InfernoError(
                    f"prompt of {prompt_tokens} tokens + {new_tokens} new tokens = {needed}, more than the "
                    f"{capacity} tokens the model's global layers can hold"
                )
            return cache
        if prompt_tokens > context:
            raise InfernoError(
                f"prompt of {prompt_tokens} tokens is longer than the model's context of {context}"
            )
        if layout is None:
            if dtype != DEFAULT_DTYPE:
                raise InfernoError(f"a {dtype} element type needs a KV cache, and none was asked for")
            if needed > context:
                raise InfernoError(
                    f"prompt of {prompt_tokens} tokens + {new_tokens} new tokens = {needed}, "
                    f"more than the model's context of {context}"
                )
            return None
        capacity = max_context or needed
        if capacity > context:
            raise InfernoError(
                f"a cache of {capacity} tokens is more than the model's context of {context}"
            )
        if needed > capacity:
            raise InfernoError(
                f"prompt of {prompt_tokens} tokens + {new_tokens} new tokens = {needed}, "
                f"more than the cache's {capacity} tokens"
            )
        return make_cache(layout, self.config.kv_geometry, capacity, dtype, **options)

    def ready_for(self, rows: int) -> None:
        """Before the first forward of `rows` rows or more that takes the BLAS path, load (or compile)
        its kernels, so that forward measures work; the time counts in `startup.jit_ms`. Short prompts
        never need them, and a run that has none does not pay for them."""
        if self._matmul_ready or rows <= BATCH_ROWS:
            return
        with self._counted_as_kernels():
            warm_up_matmul(self.model)
        self._matmul_ready = True

    def _ready_cache(self, cache: KVCache | None, layout: str | None, dtype: str) -> None:
        """Before the first timed forward into a layout and element type, with the model's activations,
        that this engine has not run yet, `warm_up` runs them: the kernels are loaded (or compiled) now,
        counted in `startup.jit_ms`, not in the request's first forwards. Through the request's cache
        (left empty) for another layout or element type; for `load`'s own, or none, through the
        warm-up's small model and cache (only the activations can be new there)."""
        activations = self.model.activations
        if cache is None or (layout, dtype) == (WARM_LAYOUT, DEFAULT_DTYPE):
            key, through = (WARM_LAYOUT, DEFAULT_DTYPE, activations), None
        else:
            key, through = (layout, dtype, activations), cache
        if key in self._caches_ready or (through is not None and not _holds_warm_up(through)):
            return  # (too small a cache: its kernels load in the request's first forwards)
        with self._counted_as_kernels():
            warm_up(self.model, through)
        self._caches_ready.add(key)

    @contextmanager
    def _counted_as_kernels(self) -> Iterator[None]:
        """Time spent loading kernels after start-up still counts in `startup.jit_ms`."""
        t = perf_counter()
        yield
        self.startup = replace(self.startup, jit_ms=self.startup.jit_ms + (perf_counter() - t) * 1000)

    # -- the Python API ------------------------------------------------------------------------

    def prompt_text(self, prompt: str, chat: bool = False, system: str | None = None) -> str:
        """What the tokenizer is given: the prompt, or with `chat` the model's chat template around it
        (and the `system` message before it)."""
        if not chat:
            if system is not None:
                raise InfernoError("a system message needs the chat template (--chat)")
            return prompt
        messages = [{"role": "system", "content": system}] if system is not None else []
        return self.tokenizer.apply_chat_template([*messages, {"role": "user", "content": prompt}])

    def scheduler(
        self,
        kv: str | None = "paged",
        kv_dtype: str = DEFAULT_DTYPE,
        max_batch: int = 8,
        step_tokens: int | None = None,
        max_context: int | None = None,
        pool_tokens: int | None = None,
        pool_blocks: int | None = None,
        block_size: int = BLOCK_SIZE,
        max_waiting: int | None = None,
        **cache_options,
    ) -> Scheduler:
        """A scheduler on this model (`inferno.runtime.scheduler`): requests added to it run together.

        kv "paged": every request's cache is a sequence of one block pool of `pool_blocks` blocks, or
        enough for `pool_tokens` tokens of one sequence (default: max_batch sequences of the model's
        context; memory becomes resident only as blocks are written), with prefix caching across
        requests and preemption when it runs short. Any
        other layout: a cache of its own per request (`make_cache`); None: the naive path, one request
        at a time.
        """
        if kv != "paged":
            if kv is None:
                max_batch = 1

            def own_cache(prompt_tokens: int, new_tokens: int) -> KVCache | None:
                return self.make_cache(kv, prompt_tokens, new_tokens, max_context, kv_dtype, **cache_options)

            return Scheduler(self.model, self.tokenizer, own_cache, None, max_batch, step_tokens, max_waiting)
        if cache_options:
            raise InfernoError(f"{', '.join(cache_options)} do not apply to a 'paged' cache")
        context = min(max_context or self.config.context_length, self.config.context_length)
        geometry = self.config.kv_geometry
        tokens = pool_tokens or max_batch * context
        blocks = pool_blocks or BlockPool.sequence_blocks(geometry, tokens, block_size)
        pool = BlockPool(geometry, blocks, block_size, kv_dtype)
        self._ready_cache(PagedKVCache(geometry, WARM_TOKENS, pool=pool, dtype=kv_dtype), "paged", kv_dtype)

        def sequence(prompt_tokens: int, new_tokens: int) -> KVCache:
            needed = prompt_tokens + new_tokens
            if needed > context:
                raise InfernoError(f"prompt of {prompt_tokens} tokens + {new_tokens} new tokens = {needed}, "
                                   f"more than the context of {context}")
            if BlockPool.sequence_blocks(geometry, needed, block_size) > pool.n_blocks:
                raise InfernoError(f"{needed} tokens need more blocks than the pool's {pool.n_blocks} "
                                   f"of {block_size} tokens")
            self.ready_for(prompt_tokens)
            return PagedKVCache(geometry, needed, pool=pool, dtype=kv_dtype)

        return Scheduler(self.model, self.tokenizer, sequence, pool, max_batch, step_tokens, max_waiting)

    def start(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        kv: str | None = "prealloc",
        sampler: Sampler | None = None,
        kv_dtype: str = DEFAULT_DTYPE,
        max_context: int | None = None,
        cache: KVCache | None = None,
        ignore_eos: bool = False,
        stop: Sequence[str] = (),
        **cache_options,
    ) -> Iterator[tuple[Generation, str]]:
        """One request through a scheduler of its own: after each token, the live Generation and the
        text that can now be shown. It ends at a stop token, one of the `stop` strings (finish_reason
        "stop") or max_new_tokens ("length"); the cache is kept in `Generation.cache`.

        cache: a cache already holding a prefix of prompt_ids (a loaded snapshot); else one of layout
        `kv` with rows of element type `kv_dtype` is made for the request (None: no cache, the naive
        path) with cache_options (`window=256`).
        """
        prompt_ids = arguments.token_ids("prompt_ids", prompt_ids, self.config.vocab_size)
        arguments.count("max_new_tokens", max_new_tokens)
        if cache is None:
            cache = self.make_cache(kv, len(prompt_ids), max_new_tokens, max_context, kv_dtype,
                                    **cache_options)
        scheduler = Scheduler(self.model, self.tokenizer)
        request = Request(list(prompt_ids), max_new_tokens, sampler or Sampler(), tuple(stop), ignore_eos,
                          keep_cache=True, cache=cache)
        rid = scheduler.add(request)
        while scheduler.has_work:
            for event in scheduler.step():
                if event.error is not None:
                    raise InfernoError(event.error)
                yield scheduler.get(rid), event.text

    def stream(self, prompt: str, max_new_tokens: int = 32, chat: bool = False, system: str | None = None,
               **options) -> Iterator[str]:
        """The generated text, piece by piece as tokens come (options: those of `start`)."""
        _check_prompt(prompt, max_new_tokens, chat, system)
        prompt_ids = self.tokenizer.encode(self.prompt_text(prompt, chat, system))
        for _, piece in self.start(prompt_ids, max_new_tokens, **options):
            yield piece

    def run(self, prompt_ids: list[int], max_new_tokens: int, **options) -> Generation:
        """`start` to the end: the finished Generation (tokens, text, metrics, cache)."""
        prompt_ids = arguments.token_ids("prompt_ids", prompt_ids, self.config.vocab_size)
        arguments.count("max_new_tokens", max_new_tokens)
        *_, (generation, _) = self.start(prompt_ids, max_new_tokens, **options)
        return generation

    def generate(self, prompt: str, max_new_tokens: int = 32, chat: bool = False, system: str | None = None,
                 **options) -> RunRecord:
        """Generate to the end (or a stop string) and return the run's record: text, ids, metrics."""
        _check_prompt(prompt, max_new_tokens, chat, system)
        text = self.prompt_text(prompt, chat, system)
        t0 = perf_counter()
        generation = self.run(self.tokenizer.encode(text), max_new_tokens, **options)
        return self.record(generation, text, (perf_counter() - t0) * 1000)

    def record(
        self, generation: Generation, prompt: str, wall_ms: float, load_cache_ms: float | None = None
    ) -> RunRecord:
        """The record of a finished (or interrupted) generation of `prompt` on this engine: its text as
        shown (without a stop token, cut before a stop string)."""
        output = generation.output
        return RunRecord(
            model=self.path,
            prompt=prompt,
            prompt_ids=generation.prompt_ids,
            token_ids=output.token_ids,
            text=output.text,
            finish_reason=generation.finish_reason,
            metrics=generation.metrics,
            startup=self.startup,
            wall_ms=wall_ms,
            load_cache_ms=load_cache_ms,
            stopped_by=output.stopped_by,
        )


def _check_prompt(prompt: object, max_new_tokens: object, chat: object, system: object) -> None:
    """generate's and stream's arguments, each refused by name (a str count, a bool, a bytes prompt)."""
    arguments.text("prompt", prompt)
    arguments.count("max_new_tokens", max_new_tokens)
    arguments.flag("chat", chat)
    arguments.text("system", system, optional=True)


def load(path: str | os.PathLike, progress: Progress | None = None) -> Engine:
    """Load a GGUF model: `inferno.load("model.gguf")`."""
    return Engine.load(path, progress)


def release_freed_heap() -> None:
    """Hand the heap that building the tokenizer (its JSON parse, or the GGUF's metadata) freed back to
    the OS: glibc keeps it otherwise, and the compiled kernels loaded next do not reuse it (20 MB of
    the peak RSS). A no-op on a C library without malloc_trim."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


HEAP_BELOW = 64 << 20  # bytes: allocations smaller than this come from glibc's heap (see reuse_freed_pages)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def reuse_freed_pages() -> None:
    """Have glibc serve a forward's large temporaries (a layer's activations: 18 MB each for a 1.5B
    model's 512-token prefill) from its heap and keep their pages when they are freed, up to twice
    HEAP_BELOW, rather than map fresh pages for each and unmap them after: touching a fresh page is
    what costs (docs/LOG.md). Set once the model is loaded, whose own temporaries went back to the OS.
    A no-op on a C library without mallopt."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, HEAP_BELOW)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * HEAP_BELOW)


WARM_LAYOUT = "prealloc"  # the cache layout warm_up runs: the default run's; others are warmed on first use
WARM_TOKENS = 3  # a prompt of two (a short prompt's kernels: batch_matmul's) and a decode step (matvec's)


def _holds_warm_up(cache: KVCache) -> bool:
    """Whether `warm_up` fits in `cache`: WARM_TOKENS positions, and for a paged one the pool's blocks."""
    if cache.capacity < WARM_TOKENS:
        return False
    return not isinstance(cache, PagedKVCache) or cache.blocks_needed(WARM_TOKENS) <= cache.pool.free_blocks


def warm_up(model: Transformer, cache: KVCache | None = None) -> None:
    """Run every kernel a request needs once, so the first timed forward measures work, not compiling
    or loading: a two-token prefill and one decode step, into `cache` (left empty again), or through
    one layer of each kind (`one_layer_of_each_kind`) into a WARM_LAYOUT cache of WARM_TOKENS. (The BLAS
    path's kernels, for long prompts, are warmed when one first comes: `warm_up_matmul`.)"""
    tokens = np.arange(WARM_TOKENS) % model.config.vocab_size  # any ids the embedding has
    if cache is None:
        model = model.one_layer_of_each_kind()
        cache = make_cache(WARM_LAYOUT, model.config.kv_geometry, len(tokens))
    with refusing_non_finite(0):
        check_logits(model.prefill(tokens[:-1], cache), len(tokens) - 2)
        check_logits(model.decode(int(tokens[-1]), len(tokens) - 1, cache), len(tokens) - 1)
    cache.reset()


def warm_up_matmul(model: Transformer) -> None:
    """The BLAS matmul of each block type the layers hold, on one tile (a prompt long enough to take
    that path would dequantize every weight to warm it), and prefill attention over query blocks, on
    a prompt just long enough to take that path (attention.ROWWISE_PAIRS)."""
    for matrix in {m.qtype: m for m in model.layer_matrices()}.values():
        matrix.first_tile().matmul(np.zeros((MATMUL_MIN_ROWS, matrix.cols), np.float32))
    g, n = model.config.kv_geometry, math.isqrt(attention.ROWWISE_PAIRS) + 1
    kv = np.zeros((n, g.kv_width), np.float32)
    attention.attention_prefill(np.zeros((n, g.heads * g.head_dim), np.float32), kv, kv, g.heads, 0)
