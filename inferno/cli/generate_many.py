"""model-generate's many-sequence modes: `--num-samples N` (one prompt, N continuations sharing its
blocks) and `--batch FILE` (one prompt per line, common prefixes reused), both batch-decoded in a paged
block pool with one model load."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from inferno import batching
from inferno.cli.common import console
from inferno.cli.display import fmt_bytes
from inferno.engine import Engine
from inferno.errors import InfernoError
from inferno.sampling import Sampler

BATCH_OPTIONS = ("prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos")


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


def read_batch(path: str, defaults: Defaults) -> list[dict]:
    """One prompt per line, or a JSON object per line with `prompt` and per-prompt options."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InfernoError(f"cannot read --batch {path}: {exc}") from None
    if not lines:
        raise InfernoError(f"--batch {path} holds no prompts")
    entries = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            raise InfernoError(f"--batch {path} line {number} is empty")
        entry = {"prompt": line}
        if line.lstrip().startswith("{"):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InfernoError(f"--batch {path} line {number}: not JSON ({exc.msg})") from None
            unknown = set(entry) - set(BATCH_OPTIONS)
            if unknown or not isinstance(entry.get("prompt"), str):
                raise InfernoError(f"--batch {path} line {number}: needs a string \"prompt\" and only "
                                   f"{', '.join(BATCH_OPTIONS)} (got {', '.join(sorted(entry))})")
        options = vars(defaults) | entry
        if not isinstance(options["max_new_tokens"], int) or options["max_new_tokens"] < 1:
            raise InfernoError(f"--batch {path} line {number}: max_new_tokens must be a whole number >= 1")
        entries.append(options)
    return entries


def make_request(engine: Engine, options: dict, seed: int | None = None) -> batching.Request:
    prompt_ids = engine.tokenizer.encode(engine.prompt_text(options["prompt"], options["chat"]))
    engine.make_cache(None, len(prompt_ids), options["max_new_tokens"])  # refuses what cannot fit
    sampler = Sampler(options["temperature"], options["top_k"], options["top_p"], seed)
    is_stop = (lambda _: False) if options["ignore_eos"] else engine.tokenizer.is_stop
    return batching.Request(prompt_ids, options["max_new_tokens"], sampler, is_stop)


def run_samples(engine: Engine, prompt: str, n: int, defaults: Defaults, block_size: int,
                as_json: bool) -> None:
    """N continuations of one prompt: sample i is seeded with seed + i, as `--seed (seed + i)` alone."""
    options = vars(defaults) | {"prompt": prompt}
    seeds = [None if defaults.seed is None else defaults.seed + i for i in range(n)]
    requests = [make_request(engine, options, seed) for seed in seeds]
    prompt_ids = requests[0].prompt_ids
    pool = batching.samples_pool(engine.config.kv_geometry, len(prompt_ids), defaults.max_new_tokens, n,
                                 block_size)
    result = batching.run(engine.model, requests, pool, batching.samples_start(engine.model, pool), n)
    geometry = engine.config.kv_geometry
    summary = result.to_json() | {
        "samples": n,
        "unshared_prompt_bytes": n * geometry.nbytes(len(prompt_ids), 4),
        "unshared_peak_bytes": sum(geometry.nbytes(len(prompt_ids) + len(c.token_ids), 4)
                                   for c in result.completions),
    }
    texts = [engine.tokenizer.decode(c.token_ids) for c in result.completions]
    if as_json:
        samples = [c.to_json() | {"index": i, "seed": seeds[i], "text": texts[i]}
                   for i, c in enumerate(result.completions)]
        json.dump({"prompt": prompt, "prompt_ids": prompt_ids, "samples": samples, "metrics": summary},
                  sys.stdout)
        print()
        return
    out, err = console(), console(stderr=True)
    for i, (done, text) in enumerate(zip(result.completions, texts, strict=True)):
        seed = "" if seeds[i] is None else f", seed {seeds[i]}"
        err.print(f"── sample {i}{seed}: {len(done.token_ids)} tokens, {_rate(done.decode_tok_s)}",
                  style="dim", highlight=False)
        out.print(prompt, style="dim", end="", markup=False)
        print(text, flush=True)
    err.print(
        f"{n} samples, {len(prompt_ids)}-token prompt prefilled once: decode {_rate(result.decode_tok_s)} "
        f"in all over {result.steps} batched steps\n"
        f"prompt K/V held once: {fmt_bytes(result.start_cache_bytes)} "
        f"(one copy each: {fmt_bytes(summary['unshared_prompt_bytes'])}); "
        f"peak cache {fmt_bytes(result.peak_cache_bytes)} "
        f"(unshared: {fmt_bytes(summary['unshared_peak_bytes'])}), blocks of {block_size} tokens",
        highlight=False,
    )


def run_batch(engine: Engine, path: str, defaults: Defaults, block_size: int, max_batch: int,
              as_json: bool) -> None:
    """Every prompt of the file, up to max_batch decoding at a time, shared prefixes reused."""
    entries = read_batch(path, defaults)
    requests = [make_request(engine, e, e["seed"]) for e in entries]  # all refused before any work
    pool = batching.pool_for(engine.config.kv_geometry, requests, max_batch, block_size)
    result = batching.run(engine.model, requests, pool, batching.prefix_start(engine.model, pool), max_batch)
    out, err = console(), console(stderr=True)
    for i, (entry, done) in enumerate(zip(entries, result.completions, strict=True)):
        text = engine.tokenizer.decode(done.token_ids)
        if as_json:
            print(json.dumps(done.to_json() | {"index": i, "prompt": entry["prompt"], "text": text}))
            continue
        err.print(f"── prompt {i}: {done.reused_tokens} of {len(done.prompt_ids)} prompt tokens reused, "
                  f"{len(done.token_ids)} generated", style="dim", highlight=False)
        out.print(entry["prompt"], style="dim", end="", markup=False)
        print(text, flush=True)
    summary = result.to_json() | {"prompts": len(requests), "max_batch": max_batch}
    if as_json:
        print(json.dumps({"summary": summary}))
        return
    err.print(
        f"{len(requests)} prompts in {result.wall_ms / 1000:.2f} s: {summary['reused_tokens']} of "
        f"{summary['prompt_tokens']} prompt tokens reused from the prefix cache; decode "
        f"{_rate(result.decode_tok_s)} in all, {summary['mean_batch'] or 0:.1f} sequences per step; "
        f"peak cache {fmt_bytes(result.peak_cache_bytes)}",
        highlight=False,
    )


def _rate(tok_s: float | None) -> str:
    return "-" if tok_s is None else f"{tok_s:.1f} tok/s"
