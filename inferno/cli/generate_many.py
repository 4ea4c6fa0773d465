"""model-generate's many-sequence modes: `--num-samples N` (one prompt, N continuations) and `--batch
FILE` (one prompt per line, or JSON lines with options of their own), run together by the engine's
scheduler. In a paged cache (the default) they share one block pool: N samples compute the prompt's
full blocks once, and a batch's prompts reuse each other's common prefixes."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from time import perf_counter

from inferno.cli.common import console, read_text_file
from inferno.cli.display import counting, fmt_bytes
from inferno.cli.generate import MAX_NEW_TOKENS, prompt_context
from inferno.errors import InfernoError
from inferno.model.sampling import MIN_TEMPERATURE, Sampler
from inferno.runtime.engine import Engine
from inferno.runtime.scheduler import Generation, Request, Scheduler

BATCH_OPTIONS = ("prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "stop")
# each option's JSON type: bool is refused where a number is asked for (JSON's true is not 1)
NUMBERS = {"max_new_tokens": (int,), "temperature": (int, float), "top_k": (int,), "top_p": (int, float),
           "seed": (int, type(None))}


@dataclass
class Defaults:
    """The command line's options, which each --batch line may override."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    ignore_eos: bool
    chat: bool
    stop: list[str] = field(default_factory=list)
    system: str | None = None


@dataclass
class Cache:
    """The cache flags: layout, element type and the layout's own options."""

    kv: str
    kv_dtype: str
    options: dict


MAX_BATCH_PROMPTS = 65_536
BATCH_FILE_LIMIT = 64 * 2**20  # bytes: 4,096 prompts of the 16 MiB a --prompt-file may be would never run


def read_batch(path: str, defaults: Defaults) -> list[dict]:
    """One prompt per line, or a JSON object per line with `prompt` and per-prompt options. Lines end at
    \n (a \r before it is dropped), not at the other characters str.splitlines() ends lines at (U+2028
    is text inside a JSON string); a byte order mark at the start is not part of the first line."""
    text = read_text_file("--batch", path, BATCH_FILE_LIMIT, "a batch file", encoding="utf-8-sig")
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    if lines and not lines[-1]:
        lines.pop()  # the file's last line ends with a newline
    if len(lines) > MAX_BATCH_PROMPTS:  # each a request held from the start: memory grows with them
        raise InfernoError(f"--batch {path} holds {len(lines):,} lines, more than the {MAX_BATCH_PROMPTS:,} "
                           "prompts a run takes: split it")
    if not lines:
        raise InfernoError(f"--batch {path} holds no prompts")
    return [parse_line(line, f"--batch {path} line {number}", defaults)
            for number, line in enumerate(lines, 1)]


def parse_line(line: str, where: str, defaults: Defaults) -> dict:
    """A line's options over the command line's, each checked for its type."""
    if not line.strip():
        raise InfernoError(f"{where} is empty")
    entry: object = {"prompt": line}
    if line.lstrip().startswith("{"):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InfernoError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        except RecursionError:
            raise InfernoError(f"{where}: not JSON (nested too deeply)") from None
        except ValueError:  # a number past Python's 4,300-digit int conversion limit
            raise InfernoError(f"{where}: holds a number too long to read") from None
        if not isinstance(entry, dict):
            raise InfernoError(f"{where}: a JSON line is an object with a \"prompt\"")
        unknown = set(entry) - set(BATCH_OPTIONS)
        if unknown or not isinstance(entry.get("prompt"), str):
            raise InfernoError(f"{where}: needs a string \"prompt\" and only {', '.join(BATCH_OPTIONS)} "
                               f"(got {', '.join(sorted(map(str, entry)))})")
    options = vars(defaults) | entry
    for name, types in NUMBERS.items():
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, types) or (
                isinstance(value, float) and not math.isfinite(value)):
            kinds = " or ".join(t.__name__ for t in types)
            raise InfernoError(f"{where}: {name} must be a number ({kinds}), got {json.dumps(value)[:40]}")
        if float in types and isinstance(value, int) and abs(value) > 1e300:  # sampling divides by it
            raise InfernoError(f"{where}: {name} is past what a float holds, got {_shown(value)}")
    limits = (("max_new_tokens", 1 <= options["max_new_tokens"] <= MAX_NEW_TOKENS,
               f"from 1 to {MAX_NEW_TOKENS:,}, the most a run can take"),
              ("temperature", options["temperature"] == 0 or options["temperature"] >= MIN_TEMPERATURE,
               f"0 (greedy) or from {MIN_TEMPERATURE} up"),
              ("top_k", options["top_k"] >= 0, "0 (off) or more"),
              ("top_p", 0 < options["top_p"] <= 1, "in (0, 1]"),
              ("seed", options["seed"] is None or options["seed"] >= 0, "0 or more"))
    for name, within, rule in limits:
        if not within:
            raise InfernoError(f"{where}: {name} must be {rule}, got {_shown(options[name])}")
    if not isinstance(options["ignore_eos"], bool):
        raise InfernoError(f"{where}: ignore_eos must be true or false")
    stop = options["stop"]
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InfernoError(f"{where}: stop must be a non-empty string or a list of them")
    for text in [options["prompt"], *stop]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InfernoError(f"{where}: holds text that is not valid Unicode (a lone surrogate)") from None
    return options | {"stop": stop}


def _shown(value: object) -> str:
    """A number of a --batch line in a message: a 5,000-digit one as its size."""
    if isinstance(value, int) and value.bit_length() > 200:
        return f"a {len(str(value)):,}-digit number" if value.bit_length() < 14_000 else "a huge number"
    return repr(value)


def make_request(engine: Engine, options: dict, seed: int | None, kv: str | None = None) -> Request:
    text = engine.prompt_text(options["prompt"], options["chat"], options.get("system"))
    prompt_ids = engine.tokenizer.encode(text, prompt_context(engine, kv))
    try:
        sampler = Sampler(options["temperature"], options["top_k"], options["top_p"], seed)
    except OverflowError as exc:
        raise InfernoError(f"a sampling option is out of range: {exc}") from None
    return Request(prompt_ids, options["max_new_tokens"], sampler, tuple(options["stop"]),
                   options["ignore_eos"])


@dataclass
class Run:
    """What the scheduler did for the requests: each one's finished Generation, and the pool's use."""

    generations: list[Generation]
    wall_ms: float
    steps: int
    decode_steps: int  # steps that computed only decode tokens, every request admitted
    decode_ms: float  # of those steps
    decode_tokens: int
    peak_cache_bytes: int  # of blocks held (a shared block once), or of every request's own cache
    start_cache_bytes: int  # held when the first decode step began (N samples: the prompt, once)
    preemptions: int

    @property
    def decode_tok_s(self) -> float | None:
        """Aggregate: tokens of every sequence per second of the steps that only decoded."""
        return self.decode_tokens / (self.decode_ms / 1000) if self.decode_ms else None

    def to_json(self, scheduler: Scheduler) -> dict:
        pool = scheduler.pool
        return {"wall_ms": self.wall_ms, "steps": self.steps, "decode_steps": self.decode_steps,
                "decode_ms": self.decode_ms,
                "decode_tokens": self.decode_tokens, "decode_tok_s": self.decode_tok_s,
                "start_cache_bytes": self.start_cache_bytes, "peak_cache_bytes": self.peak_cache_bytes,
                "pool_bytes": pool.nbytes if pool else None, "block_size": pool.block_size if pool else None,
                "preemptions": self.preemptions,
                "reused_tokens": sum(g.metrics.reused_tokens for g in self.generations),
                "prompt_tokens": sum(g.metrics.prompt_tokens for g in self.generations),
                "activations": scheduler.model.activations}


def run_all(scheduler: Scheduler, requests: list[Request], err=None) -> Run:
    """Every request through the scheduler, to the end (on the console `err`: requests finished of N)."""
    with counting(err, len(requests), "requests finished") as advance:
        return _run_all(scheduler, requests, advance)


def _run_all(scheduler: Scheduler, requests: list[Request], advance) -> Run:
    ids = [scheduler.add(r) for r in requests]
    live: dict[int, Generation] = {i: scheduler.get(i) for i in ids}
    peak = start = steps = decode_steps = decode_tokens = 0
    decode_ms = 0.0
    t0 = perf_counter()
    while scheduler.has_work:
        decoding = all(g.computed == len(g.tokens) - 1 and g.token_ids for g in scheduler.running)
        batch = len(scheduler.running)
        t = perf_counter()
        events = scheduler.step()
        steps += 1
        if decoding and batch and not scheduler.waiting:
            start = start or _held(scheduler, live.values())
            decode_ms += (perf_counter() - t) * 1000
            decode_tokens += sum(e.token is not None for e in events)
            decode_steps += 1
        peak = max(peak, _held(scheduler, live.values()))
        for event in events:
            if event.error is not None:
                raise InfernoError(event.error)
        advance(sum(event.finish_reason is not None for event in events))
    if scheduler.pool is not None:
        peak = scheduler.peak_blocks * scheduler.pool.block_nbytes
    generations = [scheduler.pop(i) for i in ids]
    return Run(generations, (perf_counter() - t0) * 1000, steps, decode_steps, decode_ms, decode_tokens, peak,
               start, scheduler.preemptions)


def _held(scheduler: Scheduler, generations) -> int:
    if scheduler.pool is not None:
        return scheduler.pool.used_nbytes
    return sum(g.cache.nbytes for g in generations if g.cache is not None)


def pool_tokens(requests: list[Request], max_batch: int, context: int | None = None) -> int:
    """A pool the max_batch largest requests fit in together, unshared: it never has to preempt. A
    request is counted up to the context (one past it is refused when it is added, not allocated for)."""
    most = context or 2**62
    need = sorted((min(len(r.prompt_ids) + r.max_new_tokens, most) for r in requests), reverse=True)
    return sum(need[:max_batch])


def scheduler_for(engine: Engine, cache: Cache, requests: list[Request], max_batch: int) -> Scheduler:
    if cache.kv == "paged":
        tokens = pool_tokens(requests, max_batch, engine.config.context_length)
        return engine.scheduler("paged", cache.kv_dtype, max_batch, pool_tokens=tokens, **cache.options)
    return engine.scheduler(cache.kv, cache.kv_dtype, max_batch, **cache.options)


def run_samples(engine: Engine, prompt: str, n: int, defaults: Defaults, cache: Cache, as_json: bool,
                quiet: bool = False) -> None:
    """N continuations of one prompt: sample i is seeded with seed + i, as `--seed (seed + i)` alone."""
    options = vars(defaults) | {"prompt": prompt}
    seeds = [None if defaults.seed is None else defaults.seed + i for i in range(n)]
    requests = [make_request(engine, options, seed, cache.kv) for seed in seeds]
    scheduler = scheduler_for(engine, cache, requests, n)
    out, err = console(), console(stderr=True)
    err.quiet = quiet or as_json
    run = run_all(scheduler, requests, err)
    prompt_ids = requests[0].prompt_ids
    geometry = engine.config.kv_geometry
    summary = run.to_json(scheduler) | {
        "samples": n,
        "unshared_prompt_bytes": n * geometry.nbytes(len(prompt_ids), 4),
        "unshared_peak_bytes": sum(geometry.nbytes(len(prompt_ids) + len(g.token_ids), 4)
                                   for g in run.generations),
    }
    if as_json:
        samples = [completion(g) | {"index": i, "seed": seeds[i]} for i, g in enumerate(run.generations)]
        json.dump({"prompt": prompt, "prompt_ids": prompt_ids, "samples": samples, "metrics": summary},
                  sys.stdout)
        print()
        return
    for i, g in enumerate(run.generations):
        seed = "" if seeds[i] is None else f", seed {seeds[i]}"
        err.print(f"── sample {i}{seed}: {len(g.output.token_ids)} tokens, {_rate(g.metrics.decode_tok_s)}",
                  style="dim", highlight=False)
        out.print(prompt, style="dim", end="", markup=False)
        print(g.output.text, flush=True)
    reused = summary["reused_tokens"]
    err.print(
        f"{n} samples of a {len(prompt_ids)}-token prompt ({reused} prompt tokens reused from the prefix "
        f"cache): decode {_rate(run.decode_tok_s)} in all over {run.steps} steps\n"
        f"K/V held when decoding began: {fmt_bytes(run.start_cache_bytes)} "
        f"(one prompt copy each: {fmt_bytes(summary['unshared_prompt_bytes'])}); "
        f"peak cache {fmt_bytes(run.peak_cache_bytes)} "
        f"(unshared: {fmt_bytes(summary['unshared_peak_bytes'])})",
        highlight=False,
    )


def run_batch(engine: Engine, path: str, defaults: Defaults, cache: Cache, max_batch: int,
              as_json: bool, quiet: bool = False) -> None:
    """Every prompt of the file, up to max_batch running at a time, shared prefixes reused."""
    entries = read_batch(path, defaults)
    requests = [make_request(engine, e, e["seed"], cache.kv) for e in entries]
    scheduler = scheduler_for(engine, cache, requests, max_batch)
    out, err = console(), console(stderr=True)
    err.quiet = quiet or as_json
    run = run_all(scheduler, requests, err)
    for i, (entry, g) in enumerate(zip(entries, run.generations, strict=True)):
        if as_json:
            print(json.dumps(completion(g) | {"index": i, "prompt": entry["prompt"]}))
            continue
        err.print(f"── prompt {i}: {g.metrics.reused_tokens} of {len(g.prompt_ids)} prompt tokens reused, "
                  f"{len(g.output.token_ids)} generated", style="dim", highlight=False)
        out.print(entry["prompt"], style="dim", end="", markup=False)
        print(g.output.text, flush=True)
    summary = run.to_json(scheduler) | {"prompts": len(requests), "max_batch": max_batch}
    if as_json:
        print(json.dumps({"summary": summary}))
        return
    err.print(
        f"{len(requests)} prompts in {run.wall_ms / 1000:.2f} s: {summary['reused_tokens']} of "
        f"{summary['prompt_tokens']} prompt tokens reused from the prefix cache; decode "
        f"{_rate(run.decode_tok_s)} in all; peak cache {fmt_bytes(run.peak_cache_bytes)}",
        highlight=False,
    )


def completion(g: Generation) -> dict:
    """One request's result as --json prints it."""
    return {"prompt_tokens": len(g.prompt_ids), "reused_tokens": g.metrics.reused_tokens,
            "token_ids": g.output.token_ids, "text": g.output.text, "finish_reason": g.finish_reason,
            "stopped_by": g.output.stopped_by, "ttft_ms": g.metrics.ttft_ms,
            "decode_tok_s": g.metrics.decode_tok_s}


def _rate(tok_s: float | None) -> str:
    return "-" if tok_s is None else f"{tok_s:.1f} tok/s"
