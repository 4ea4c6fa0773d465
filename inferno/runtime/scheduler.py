"""The scheduler: requests join and leave between steps, and each step is one forward over every
running sequence (vLLM v1's shape). There is no prefill phase and no decode phase: a request has
tokens computed (their K/V are in its cache) and tokens known (its prompt and what it generated), and
each step spends a token budget over the gaps: one token for a decoding sequence, a chunk of a prompt
for a prefilling one, beside each other in one ragged batch.

    scheduler = engine.scheduler(kv="paged", max_batch=8)
    rid = scheduler.add(Request(prompt_ids, max_new_tokens=32))
    while scheduler.has_work:
        for event in scheduler.step():      # schedule, execute, update
            print(event.text, end="")

Sampling, stop tokens and strings, length, finish reasons, non-finite logits, the text as it can be
shown and each request's metrics are decided here, once, for every mode that generates.

A paged cache's blocks are the scheduler's to account for: a sequence's blocks for a step are reserved
before the forward (never inside it); when the pool runs short, the request admitted last gives its
blocks back and waits to be computed again (preemption by recompute). Its generated tokens are kept,
so it resumes where it was, and with greedy sampling its tokens do not change.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from inferno.errors import InfernoError
from inferno.kv import KVCache
from inferno.kv.paged import PagedKVCache
from inferno.kv.pool import BlockPool
from inferno.model.sampling import Sampler
from inferno.model.transformer import PREFILL_CHUNK, Transformer
from inferno.model.validate import check_logits, refusing_non_finite
from inferno.runtime.metrics import Metrics
from inferno.runtime.threads import GOVERNOR
from inferno.text.output_text import OutputText
from inferno.text.tokenizer import GGUFTokenizer

# make_cache(prompt_tokens, new_tokens) -> the cache of a new request (refusing one that cannot fit)
MakeCache = Callable[[int, int], KVCache | None]

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class Request:
    """What a caller asks for: a prompt's token ids and how to continue it."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampler: Sampler = field(default_factory=Sampler)
    stop: tuple[str, ...] = ()  # strings that end the text, which is cut before them
    ignore_eos: bool = False  # generate through end-of-sequence / end-of-turn tokens
    keep_cache: bool = False  # the finished request keeps its cache (a snapshot to save), else it is freed
    cache: KVCache | None = None  # a cache already holding a prefix of prompt_ids (a loaded snapshot)


@dataclass
class Event:
    """What one step did for one request: a new token and the text it lets through, or its end."""

    request_id: int
    token: int | None  # None when the request only ended (aborted, or an error)
    text: str  # text that can now be shown (end tokens left out, held back near a stop string)
    finish_reason: str | None = None  # one of FINISH_REASONS once it ended
    logits: np.ndarray | None = None  # float32 [vocab] the token was sampled from
    error: str | None = None  # with finish_reason "error": what went wrong


@dataclass
class Generation:
    """A request as it goes; the scheduler keeps it (`get`) until the caller `pop`s it."""

    id: int
    request: Request
    output: OutputText
    metrics: Metrics
    cache: KVCache | None = None
    tokens: list[int] = field(default_factory=list)  # prompt, then every generated token
    computed: int = 0  # leading tokens whose K/V the cache holds
    finish_reason: str | None = None
    logits: np.ndarray | None = None  # what the last token was sampled from
    arrived_s: float = field(default_factory=perf_counter)
    first_token_s: float | None = None
    preemptions: int = 0

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def token_ids(self) -> list[int]:
        """Generated tokens, the stop token that ended them included."""
        return self.tokens[len(self.request.prompt_ids) :]

    @property
    def wanted(self) -> int:
        """Known tokens not computed yet: the prompt's rest, or the last sampled token."""
        return len(self.tokens) - self.computed


class Scheduler:
    """`add` requests, `abort` them, `step` them forward; `get`/`pop` a request's Generation."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: GGUFTokenizer,
        make_cache: MakeCache = lambda _prompt, _new: None,
        pool: BlockPool | None = None,
        max_batch: int = 8,
        step_tokens: int | None = None,
        max_waiting: int | None = None,
    ):
        """make_cache: the cache of each new request that brings none (None: the naive path, one
        request at a time);
        pool: the block pool its paged caches share, whose blocks this scheduler reserves;
        max_batch: sequences per step; step_tokens: tokens per step over all sequences (None: a
        prompt is computed whole in one step, chunked only for a cache that evicts); max_waiting:
        requests queued before `add` refuses (None: no bound)."""
        if max_batch < 1:
            raise InfernoError(f"a batch holds at least one sequence, got {max_batch}")
        if step_tokens is not None and step_tokens < 1:
            raise InfernoError(f"a step computes at least one token, got a budget of {step_tokens}")
        self.model, self.tokenizer, self.make_cache, self.pool = model, tokenizer, make_cache, pool
        self.max_batch, self.step_tokens, self.max_waiting = max_batch, step_tokens, max_waiting
        self.waiting: deque[Generation] = deque()
        self.running: list[Generation] = []  # in order of admission: the last is preempted first
        self._all: dict[int, Generation] = {}
        self._ended: list[Event] = []  # ends decided between steps (abort), reported by the next step
        self._next_id = 0
        self.steps = 0
        self.preemptions = 0
        self.peak_blocks = 0  # most pool blocks held after a forward, before finished requests free theirs

    # -- the three verbs ---------------------------------------------------------------------------

    def add(self, request: Request) -> int:
        """Queue a request; its id. Refuses one that can never run, and any past max_waiting."""
        if not request.prompt_ids:
            raise InfernoError("the prompt is empty (0 tokens)")
        if request.max_new_tokens < 1:
            raise InfernoError(f"max_new_tokens must be at least 1, got {request.max_new_tokens}")
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise SchedulerFullError(f"{len(self.waiting)} requests are already waiting")
        cache = request.cache
        if cache is None:
            cache = self.make_cache(len(request.prompt_ids), request.max_new_tokens)
        gen = Generation(self._next_id, request, OutputText(self.tokenizer, request.stop),
                         self._metrics_for(request, cache), cache, list(request.prompt_ids))
        gen.computed = cache.length if cache is not None else 0
        self._next_id += 1
        self._all[gen.id] = gen
        self.waiting.append(gen)
        return gen.id

    def abort(self, request_id: int) -> bool:
        """End a waiting or running request now (its blocks freed); the next step reports it.
        False when it already ended or was never added."""
        gen = self._all.get(request_id)
        if gen is None or gen.finish_reason is not None:
            return False
        if gen in self.waiting:
            self.waiting.remove(gen)
        self._finish(gen, "abort")
        self._ended.append(Event(gen.id, None, gen.output.flush(), "abort"))
        return True

    def step(self) -> list[Event]:
        """One forward over what the budget allows; the events it produced, in request order."""
        events, self._ended = self._ended, []
        batch = self._schedule()
        if not batch and not self.running and self.waiting:  # it can never start: say so, never spin
            gen = self.waiting.popleft()
            self._finish(gen, "error")
            events.append(Event(gen.id, None, "", "error", error="the request does not fit in the KV cache"))
        if batch:
            logits, ms, error = self._execute(batch)
            if self.pool is not None:
                self.peak_blocks = max(self.peak_blocks, self.pool.used_blocks)
            events += self._update(batch, logits, ms, error)
        return events

    # -- reading results ---------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._ended)

    def get(self, request_id: int) -> Generation:
        return self._all[request_id]

    def pop(self, request_id: int) -> Generation:
        """A finished request's Generation, forgotten by the scheduler."""
        gen = self._all[request_id]
        if gen.finish_reason is None:
            raise ValueError(f"request {request_id} is still running")
        return self._all.pop(request_id)

    # -- schedule ----------------------------------------------------------------------------------

    def _schedule(self) -> list[tuple[Generation, int]]:
        """(generation, tokens to compute) for this step: running requests first, in admission order,
        then waiting ones while a sequence slot, budget and blocks remain."""
        budget = self.step_tokens or math.inf
        batch: list[tuple[Generation, int]] = []
        for gen in list(self.running):
            if gen not in self.running:  # preempted to make room for an earlier one
                continue
            n = self._chunk(gen, budget)
            if n == 0:
                break
            while not self._reserve(gen, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is gen:
                    break
            else:
                batch.append((gen, n))
                budget -= n
        while self.waiting and len(self.running) < self.max_batch and budget >= 1:
            gen = self.waiting[0]
            if self._awaits_shared_prefix(gen):
                break
            if isinstance(gen.cache, PagedKVCache) and gen.computed == 0 and gen.cache.length == 0:
                gen.computed = gen.cache.reuse_prefix(gen.tokens)
                if not gen.token_ids:  # a first admission, not a preempted request's return
                    gen.metrics.reused_tokens = gen.computed
                    gen.metrics.prefilled_tokens = len(gen.prompt_ids) - gen.computed
            n = self._chunk(gen, budget)
            if not self._reserve(gen, n):
                if isinstance(gen.cache, PagedKVCache):
                    gen.cache.reset()
                    gen.computed = 0
                break
            self.waiting.popleft()
            self.running.append(gen)
            batch.append((gen, n))
            budget -= n
        naive = [entry for entry in batch if entry[0].cache is None]
        return naive[:1] if naive else batch  # a sequence with no cache runs alone

    def _chunk(self, gen: Generation, budget: float) -> int:
        """Tokens of `gen` to compute this step."""
        n = min(gen.wanted, budget)
        if gen.cache is not None and gen.cache.evicts:
            n = min(n, PREFILL_CHUNK)  # an evicting cache holds what a window needs, not a whole prompt
        return int(n)

    def _reserve(self, gen: Generation, n: int) -> bool:
        """Make `n` more positions of gen's cache writable before the forward; False when the pool
        cannot supply the blocks (nothing changes then)."""
        cache = gen.cache
        if not isinstance(cache, PagedKVCache):
            return True
        end = cache.length + n
        if cache.blocks_needed(end) > cache.pool.free_blocks:
            return False
        cache.prepare(cache.length, end)
        return True

    def _preempt(self, gen: Generation) -> None:
        """Give gen's blocks back; it waits at the front to be computed again from its known tokens."""
        self.running.remove(gen)
        gen.cache.reset()
        gen.computed = 0
        gen.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(gen)

    def _awaits_shared_prefix(self, gen: Generation) -> bool:
        """A prompt whose first block another running prompt is still computing waits for it: once
        that one's blocks are published, this one reuses them instead of computing them again (N
        samples of one prompt compute it once)."""
        if not isinstance(gen.cache, PagedKVCache) or gen.computed or not gen.cache.shares_prefixes:
            return False
        size = gen.cache.block_size
        if len(gen.tokens) <= size:
            return False
        head = gen.tokens[:size]
        return any(other.computed < len(other.prompt_ids) and other.tokens[:size] == head
                   and isinstance(other.cache, PagedKVCache) and other.cache.pool is gen.cache.pool
                   for other in self.running)

    # -- execute -----------------------------------------------------------------------------------

    def _execute(self, batch: list[tuple[Generation, int]]) -> tuple[np.ndarray | None, float, str | None]:
        """One forward over the batch: the logits of each sequence's last token, its milliseconds,
        and an error that ended it."""
        pieces, counts = [], []
        for gen, n in batch:
            first = 0 if gen.cache is None else gen.computed  # the naive path runs it all, every step
            pieces.append(gen.tokens[first : gen.computed + n])
            counts.append(gen.computed + n - first)
        tokens = np.fromiter((t for piece in pieces for t in piece), np.int64, sum(counts))
        t = perf_counter()
        try:
            with refusing_non_finite(len(batch[0][0].tokens) - 1), GOVERNOR.step(len(tokens)) as threads:
                logits = self.model.forward(tokens, [gen.cache for gen, _ in batch], counts)
        except InfernoError as exc:
            return None, (perf_counter() - t) * 1000, str(exc)
        for gen, _ in batch:
            gen.metrics.threads = threads
        self.steps += 1
        return logits, (perf_counter() - t) * 1000, None

    # -- update ------------------------------------------------------------------------------------

    def _update(self, batch: list[tuple[Generation, int]], logits: np.ndarray | None, ms: float,
                error: str | None) -> list[Event]:
        events = []
        now = perf_counter()
        for b, (gen, n) in enumerate(batch):
            gen.computed += n
            self._time(gen, ms)
            if error is not None:
                self._finish(gen, "error")
                events.append(Event(gen.id, None, gen.output.flush(), "error", error=error))
                continue
            if isinstance(gen.cache, PagedKVCache):
                gen.cache.publish(gen.tokens)  # its full blocks, for later prompts that start alike
            if gen.wanted:
                continue  # a chunk of its prompt: nothing to sample yet
            events.append(self._sample(gen, logits[b], now))
        return events

    def _sample(self, gen: Generation, logits: np.ndarray, now: float) -> Event:
        try:
            check_logits(logits, len(gen.tokens) - 1)
        except InfernoError as exc:
            self._finish(gen, "error")
            return Event(gen.id, None, gen.output.flush(), "error", error=str(exc))
        token = gen.request.sampler(logits)
        gen.tokens.append(token)
        gen.logits = logits
        m = gen.metrics
        m.generated_tokens += 1
        if gen.first_token_s is None:
            gen.first_token_s = now
            m.ttft_ms = (now - gen.arrived_s) * 1000
        m.decode_ms = (now - gen.first_token_s) * 1000
        is_stop = not gen.request.ignore_eos and self.tokenizer.is_stop(token)
        text = gen.output.add(token, is_stop)
        full = gen.cache is not None and not gen.cache.evicts and len(gen.tokens) > gen.cache.capacity
        reason = None
        if gen.output.stopped:
            reason = "stop"
        elif m.generated_tokens >= gen.request.max_new_tokens or full:  # full: its cache holds no more
            reason = "length"
        if reason:
            text += gen.output.flush()
            self._finish(gen, reason)
        return Event(gen.id, token, text, reason, logits)

    def _time(self, gen: Generation, ms: float) -> None:
        """The forward's milliseconds, in gen's per-forward list: a prompt's chunks add up to its
        first entry (the prefill), each later step is an entry of its own."""
        m = gen.metrics
        if m.generated_tokens == 0 and m.per_forward_ms:
            m.per_forward_ms[0] += ms
        else:
            m.per_forward_ms.append(ms)
        if gen.cache is not None:
            m.cache_bytes = gen.cache.nbytes
            m.evicted_tokens = gen.cache.evicted_tokens

    def _finish(self, gen: Generation, reason: str) -> None:
        gen.finish_reason = reason
        if gen in self.running:
            self.running.remove(gen)
        if gen.cache is not None and not gen.request.keep_cache:
            if isinstance(gen.cache, PagedKVCache):
                gen.cache.reset()  # its blocks go back to the pool; published ones stay findable
            gen.cache = None

    def _metrics_for(self, request: Request, cache: KVCache | None) -> Metrics:
        held = cache.length if cache is not None else 0
        prompt = len(request.prompt_ids)
        metrics = Metrics(prompt, prompt - held, activations=self.model.activations)
        if cache is not None:
            metrics.cache, metrics.cache_capacity = cache.layout, cache.capacity
            metrics.cache_dtype = cache.dtype.name
        return metrics


class SchedulerFullError(InfernoError):
    """The waiting queue is at its bound: a server answers 503 at once."""
