"""`kv-perplexity [MODEL.gguf] --text FILE`: a text's perplexity through the full cache and a window
cache, side by side, with what each holds."""

from __future__ import annotations

import json
import sys
from time import perf_counter

import click

from inferno.cli.common import (
    TEXT_FILE_LIMIT,
    blame,
    console,
    model_file,
    progress_on,
    quiet_console,
    quiet_option,
    read_text_file,
    run,
    script,
    set_threads,
    threads_option,
    version_option,
)
from inferno.errors import InfernoError
from inferno.kv import DEFAULT_LAYOUT
from inferno.kv.window import DEFAULT_SINKS, POSITIONS

PROG = "kv-perplexity"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", required=False, type=click.Path(dir_okay=False),
                metavar="[MODEL.gguf|smollm2|gemma3]")
@click.option("--text", "text_file", required=True, type=click.Path(dir_okay=False), metavar="FILE",
              help="The text to score (UTF-8).")
@click.option("--window", type=int, required=True, metavar="W", help="Positions each layer's window holds.")
@click.option("--sinks", type=int, default=DEFAULT_SINKS, show_default=True, help="First positions kept.")
@threads_option()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@quiet_option()
@version_option()
def command(model, text_file, window, sinks, threads, as_json, quiet):
    """Perplexity of a text teacher-forced through the full cache (prealloc) and a window cache with
    each way of handling positions: what the window costs in quality, and the memory it saves."""
    if window < 1:
        raise InfernoError(f"--window must be at least 1, got {window:,}")
    if not 0 <= sinks < window:
        raise InfernoError(f"--sinks must be from 0 to fewer than --window {window:,}, got {sinks:,}")
    set_threads(threads)
    text = read_text_file("--text", text_file, TEXT_FILE_LIMIT, "a text")
    from inferno.analysis.perplexity import PREFILL_CHUNK
    from inferno.cli.display import Counted, counting
    from inferno.runtime.engine import Engine

    err = quiet_console(quiet, as_json)
    engine = Engine.load(model_file(model), progress=progress_on(err))
    ids = engine.tokenizer.encode(text)
    if len(ids) < 2:
        raise InfernoError(f"--text {text_file} has {len(ids)} token(s): nothing to score")
    runs = [(DEFAULT_LAYOUT, {})] if len(ids) <= engine.config.context_length else []
    runs += [("window", {"window": window, "sinks": sinks, "positions": p}) for p in POSITIONS]
    rows = []
    chunks = -(-(len(ids) - 1) // PREFILL_CHUNK)  # of PREFILL_CHUNK tokens, per run
    with counting(err, chunks * len(runs), f"{len(runs)} caches: chunks") as advance:
        for layout, options in runs:
            counted = Counted(engine.model, "prefill", advance)
            rows.append(score(engine, ids, layout, options, window, counted))
    full = rows[0]["perplexity"] if rows[0]["cache"] == DEFAULT_LAYOUT else None
    for row in rows:
        row["vs_full"] = row["perplexity"] / full if full else None
    if as_json:
        json.dump({"text": text_file, "tokens": len(ids), "scored": len(ids) - 1, "runs": rows}, sys.stdout)
        print()
        return
    from rich.table import Table

    from inferno.cli.display import fmt_bytes

    table = Table(title=f"{text_file}: {len(ids):,} tokens, {len(ids) - 1:,} scored", title_justify="left")
    for name in ("cache", "positions", "perplexity", "vs full", "cache bytes", "evicted"):
        table.add_column(name, justify="left" if name in ("cache", "positions") else "right")
    for row in rows:
        label = row["cache"] if "window" not in row else f"window {row['window']} + {row['sinks']} sinks"
        table.add_row(label, row.get("positions", "all"), f"{row['perplexity']:.3f}",
                      f"{row['vs_full']:.4f}x" if row["vs_full"] else "n/a",
                      fmt_bytes(row["cache_bytes"]), f"{row['evicted_tokens']:,}")
    console().print(table)


def score(engine, ids: list[int], layout: str, options: dict, window: int, model) -> dict:
    """The text teacher-forced through a cache of `layout`: its perplexity and what the cache held."""
    from inferno.analysis.perplexity import perplexity, token_nll

    with blame("--window", window):
        cache = engine.make_cache(layout, len(ids), 0, **options)
    t = perf_counter()
    nll = token_nll(model, ids, cache)
    return {"cache": layout, **options, "perplexity": perplexity(nll), "mean_nll": float(nll.mean()),
            "cache_bytes": cache.nbytes, "evicted_tokens": cache.evicted_tokens,
            "seconds": perf_counter() - t}


def main() -> None:
    run(command, PROG)


entry = script(main)  # the console script

if __name__ == "__main__":
    entry()
