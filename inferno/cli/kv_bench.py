"""`kv-bench`: one prompt generated with no cache, `basic` and `prealloc`, side by side in one run."""

from __future__ import annotations

import json
import sys

import click

from inferno.cli.common import console, default_model, progress_on, run, set_threads, utf8, version_option
from inferno.errors import InfernoError
from inferno.kv import KINDS

PROG = "kv-bench"
MODES = ("off", *KINDS)


def bench(engine, prompt_ids: list[int], new_tokens: int, modes: tuple[str, ...]) -> dict:
    """Run each mode on the same prompt (greedy, no early stop); their metrics and token ids."""
    from inferno.generate import generate
    from inferno.sampling import Sampler

    results = {}
    for mode in modes:
        kind = None if mode == "off" else mode
        cache = engine.make_cache(kind, len(prompt_ids), new_tokens)
        done = generate(engine.model, prompt_ids, new_tokens, Sampler(), cache=cache)
        results[mode] = {"token_ids": done.token_ids, "metrics": done.metrics.to_json()}
    return results


def summary_row(metrics: dict, window: int) -> dict:
    """The figures the table shows, with the flatness ratio: last `window` decodes over the first."""
    decodes = metrics["per_forward_ms"][1:]
    n = min(window, len(decodes) // 2) or 1
    first, last = decodes[:n], decodes[-n:]
    return {
        "ttft_ms": metrics["ttft_ms"],
        "decode_tok_s": metrics["decode_tok_s"],
        "first_forward_ms": sum(first) / len(first) if decodes else None,
        "last_forward_ms": sum(last) / len(last) if decodes else None,
        "last_over_first": (sum(last) / sum(first)) if decodes else None,
        "cache_bytes": metrics["cache_bytes"],
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", required=False, type=click.Path(dir_okay=True))
@click.option("--prompt", default="Once upon a time", show_default=True)
@click.option("--new-tokens", "-n", type=int, default=128, show_default=True)
@click.option("--modes", default=",".join(MODES), show_default=True, help="Comma-separated subset to run.")
@click.option("--window", type=int, default=32, show_default=True,
              help="Decode steps averaged for the first/last forward columns.")
@click.option("--threads", type=int, default=None)
@click.option("--json", "as_json", is_flag=True)
@version_option()
def command(model, prompt, new_tokens, modes, window, threads, as_json):
    """Show what a KV cache buys: per-forward time climbs without one and stays flat with one."""
    set_threads(threads)
    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    unknown = [m for m in chosen if m not in MODES]
    if unknown or not chosen:
        raise InfernoError(f"unknown mode {','.join(unknown) or '(none)'} (valid: {', '.join(MODES)})")
    if new_tokens < 2:
        raise InfernoError(f"--new-tokens must be at least 2, got {new_tokens}")
    from inferno.engine import Engine

    err = console(stderr=True)
    engine = Engine.load(model or default_model(), progress=None if as_json else progress_on(err))
    prompt_ids = engine.tokenizer.encode(utf8("--prompt", prompt))
    results = bench(engine, prompt_ids, new_tokens, chosen)
    rows = {mode: summary_row(r["metrics"], window) for mode, r in results.items()}
    same = len({tuple(r["token_ids"]) for r in results.values()}) == 1
    if as_json:
        json.dump({"prompt_tokens": len(prompt_ids), "new_tokens": new_tokens, "identical_tokens": same,
                   "summary": rows, "runs": results}, sys.stdout)
        print()
        return
    from inferno.cli.display import bench_table, forward_chart

    out = console()
    out.print(bench_table(rows, len(prompt_ids), new_tokens, window))
    out.print(forward_chart({m: r["metrics"]["per_forward_ms"][1:] for m, r in results.items()}))
    out.print("same tokens from every mode" if same else "[bold red]the modes generated different tokens[/]")


def main() -> None:
    run(command, PROG)


if __name__ == "__main__":
    main()
