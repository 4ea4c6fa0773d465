"""`kv-inspect [MODEL.gguf] PROMPT` or `kv-inspect SNAPSHOT`: look inside a KV cache.

Runs the prompt (and --decode N greedy tokens) into a cache (--kv, prealloc by default), or reads a
saved snapshot, and shows the cache's geometry, how full it is, the tokens it holds, the mean L2 norm
of K and V per layer and KV head, and with --layer L what the last query of that layer attends to.
With --kv paged (and --num-samples N sequences forked from the prompt) it also shows the block pool:
block tables, shared blocks and their reference counts, free blocks, fragmentation. The analysis is
`inferno.analysis.cache_view`'s; this module parses flags and draws.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from inferno.analysis.cache_view import inspect_prompt, inspect_snapshot
from inferno.arguments import special_file
from inferno.cli.common import (
    blame,
    console,
    is_gguf_file,
    looks_like_model,
    model_file,
    progress_on,
    quiet_option,
    run,
    script,
    set_threads,
    threads_option,
    utf8,
    version_option,
)
from inferno.cli.display import fmt_bytes
from inferno.cli.generate import cache_options
from inferno.errors import InfernoError
from inferno.kv import DEFAULT_DTYPE, DEFAULT_LAYOUT, DTYPES, LAYOUTS
from inferno.kv.dtypes import element_type
from inferno.kv.pool import BLOCK_SIZE
from inferno.kv.snapshot import Snapshot
from inferno.kv.window import POSITIONS

PROG = "kv-inspect"
# Plasma, dark to bright: a sequential scale that stays readable where colour is scarce.
RAMP = ((13, 8, 135), (126, 3, 168), (204, 71, 120), (248, 149, 64), (240, 249, 33))
LABEL_CHARS = 10  # of a token's text in a column header


def is_snapshot_file(arg: str) -> bool:
    """A .safetensors name, or a file that is not a GGUF: read as a snapshot (which says if it is not one)."""
    if arg.endswith(".safetensors"):
        return True
    return not arg.endswith(".gguf") and os.path.isfile(arg) and not is_gguf_file(arg)


def inspect_model(
    model_path: Path,
    prompt: str,
    n_decode: int,
    layer: int | None,
    max_context: int | None,
    status: Console | None,
    layout: str = DEFAULT_LAYOUT,
    dtype: str = DEFAULT_DTYPE,
    samples: int = 1,
    **options,
) -> dict[str, Any]:
    """Load the model, fill a cache with the prompt and report on it (status: where to show progress)."""
    from inferno.runtime.engine import Engine

    engine = Engine.load(model_path, progress=progress_on(status))
    layers = engine.config.n_layers
    if layer is not None and not 0 <= layer < layers:
        raise InfernoError(f"--layer {layer} does not exist: the model has layers 0..{layers - 1}")
    with blame("--max-context", max_context):
        report = inspect_prompt(engine, engine.tokenizer.encode(prompt), n_decode, layer, max_context, layout,
                                dtype, samples, **options)
    return {"model": str(model_path)} | report


def split_args(args: tuple[str, ...]) -> tuple[Path, str]:
    """[MODEL.gguf|smollm2|gemma3] PROMPT (no model: the default one)."""
    if not args or (len(args) == 1 and looks_like_model(args[0])):
        raise click.UsageError("missing PROMPT (or a snapshot file to inspect)")
    if len(args) > 2:
        raise click.UsageError(f"too many arguments: {' '.join(args[2:])}")
    model, prompt = (args[0], args[1]) if len(args) == 2 else (None, args[0])
    return model_file(model), utf8("the prompt", prompt)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("args", nargs=-1, metavar="[MODEL.gguf|smollm2|gemma3] PROMPT | SNAPSHOT")
@click.option("--decode", "n_decode", type=int, default=0, metavar="N",
              help="Decode N greedy tokens after the prompt.")
@click.option("--layer", type=int, default=None, metavar="L",
              help="Show the attention weights of the last query in layer L (0-based).")
@click.option("--max-context", type=int, default=None,
              help="Tokens the cache is sized for (default: prompt + --decode).")
@click.option("--kv", "layout", type=click.Choice(list(LAYOUTS)), default=DEFAULT_LAYOUT, show_default=True,
              help="The cache layout to fill.")
@click.option("--window", type=int, default=None, metavar="W", help="--kv window: the window of every layer.")
@click.option("--sinks", type=int, default=None, metavar="S", help="--kv window: first positions kept.")
@click.option("--window-positions", type=click.Choice(POSITIONS), default=None,
              help="--kv window: shift or original.")
@click.option("--block-size", type=int, default=None,
              help=f"--kv paged: tokens per block (default: {BLOCK_SIZE}).")
@click.option("--num-samples", "samples", type=int, default=None, metavar="N",
              help="--kv paged: N sequences forked from the prompt, decoding together (default: 1).")
@click.option("--kv-dtype", default=DEFAULT_DTYPE, show_default=True, metavar="TYPE",
              help=f"Store the rows as {' | '.join(DTYPES)} and show what that loses per layer and KV head.")
@threads_option()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, metavar="FILE.svg|FILE.png",
              help="Also draw K/V norms, --layer's attention and --kv paged's block map into FILE.")
@quiet_option()
@version_option()
def command(args, n_decode, layer, max_context, layout, window, sinks, window_positions, block_size, samples,
            kv_dtype, threads, as_json, plot, quiet):
    """Show what a KV cache holds: geometry, fill, tokens, K/V norms, attention.

    \b
    Run a prompt:        kv-inspect [MODEL.gguf] PROMPT [--decode N] [--layer L]
    See a block pool:    kv-inspect --kv paged [--block-size N] [--num-samples N] PROMPT
    Read a snapshot:     kv-inspect SNAPSHOT   (saved by model-generate --save-cache; no model needed)
    """
    if n_decode < 0:
        raise InfernoError(f"--decode must be 0 or more, got {n_decode}")
    if max_context is not None and max_context < 1:
        raise InfernoError(f"--max-context must be at least 1, got {max_context}")
    if (block_size is not None or samples is not None) and layout != "paged":
        raise InfernoError("--block-size and --num-samples need --kv paged")
    if block_size is not None and block_size < 1:
        raise InfernoError(f"--block-size must be at least 1, got {block_size}")
    if samples is not None and samples < 1:
        raise InfernoError(f"--num-samples must be at least 1, got {samples}")
    if plot is not None:
        from inferno.analysis.plots import check_plot_file

        check_plot_file(plot)
    set_threads(threads)
    element_type(kv_dtype)
    kind_of_file = special_file(args[0]) if len(args) == 1 else None
    if kind_of_file is not None:  # a FIFO, device or directory named alone: meant as a snapshot, never one
        raise InfernoError(f"{args[0]} is {kind_of_file}: a snapshot is a regular file")
    if len(args) == 1 and is_snapshot_file(args[0]):
        if n_decode or layer is not None or max_context is not None or layout != DEFAULT_LAYOUT:
            raise InfernoError("--decode, --layer, --max-context and --kv need a model, not a snapshot")
        report = {"snapshot": args[0]} | inspect_snapshot(Snapshot.load(args[0]))
    else:
        model_path, prompt = split_args(args)
        status = None if as_json or quiet else console(stderr=True)
        options = cache_options(window, sinks, window_positions)
        if block_size is not None:
            options["block_size"] = block_size
        report = inspect_model(model_path, prompt, n_decode, layer, max_context, status,
                               layout, kv_dtype, samples or 1, **options)
    if plot is not None:
        from inferno.analysis.plots import plot_inspect

        plot_inspect(report, plot)
    if as_json:
        click.echo(json.dumps(report))
    else:
        print_report(report)


# -- the terminal view ---------------------------------------------------------------------------


def print_report(r: dict[str, Any]) -> None:
    out = console()
    source = (
        f"{Path(r['model']).name}: {r['architecture']}, {r['cache']} cache"
        if "model" in r
        else f"snapshot {r['snapshot']}: {r['architecture']}, model fingerprint {r['fingerprint'][:12]}"
    )
    out.print(Text(source, style="bold"))
    group = r["heads"] // r["kv_heads"]
    row_bytes = r["bytes_per_token"] // (2 * r["layers"])
    facts = [
        ("geometry", f"{r['layers']} layers x {r['kv_heads']} KV heads x head_dim {r['head_dim']}; "
                     f"{r['heads']} query heads, {group} per KV head"),
        ("row", f"{r['kv_width']} {r['dtype']} = {row_bytes:,} B per token and layer, for K and again for V"),
        ("keys", "stored after RoPE: a cached row never needs rotating again"
                 + ("; a window's sinks move with the slide (shift)" if r.get("window", {}).get("positions")
                    == "shift" else "")),
        ("per token", f"{r['bytes_per_token']:,} B ({row_bytes:,} B x 2 x {r['layers']} layers)"),
        ("length", f"{r['length']:,} tokens committed, at most {r['capacity']:,} held" if "window" in r
                   else f"{r['length']:,} of {r['capacity']:,} tokens committed"),
        *([("window", window_line(r["window"]))] if "window" in r else []),
        ("memory", f"{fmt_bytes(r['bytes_used'])} used of {fmt_bytes(r['bytes_allocated'])} allocated "
                   f"({r['bytes_used']:,} / {r['bytes_allocated']:,} B)"),
    ]
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for name, value in facts:
        table.add_row(name, value)
    out.print(table)
    out.print(token_line(r["tokens"]))
    out.print()
    layers = [f"L{i}" for i in range(r["layers"])]
    kv_heads = [f"kv{h}" for h in range(r["kv_heads"])]
    side_by_side(out, ("mean |K| per head", heatmap(np.array(r["key_norms"]), layers, kv_heads, "{:6.2f}")),
                 ("mean |V| per head", heatmap(np.array(r["value_norms"]), layers, kv_heads, "{:6.2f}")))
    if "key_error" in r:
        out.print()
        side_by_side(
            out,
            (f"K error of {r['dtype']}, % RMS",
             heatmap(np.array(r["key_error"]) * 100, layers, kv_heads, "{:6.2f}")),
            (f"V error of {r['dtype']}, % RMS",
             heatmap(np.array(r["value_error"]) * 100, layers, kv_heads, "{:6.2f}")),
        )
    if "blocks" in r:
        out.print()
        out.print(pool_view(r))
    if "attention" in r:
        layer, pos = r["attention"]["layer"], r["attention"]["query_pos"]
        out.print()
        out.print(Text(f"layer {layer}: attention of the last query (position {pos}) over the cache, in %",
                       style="bold"))
        out.print(attention_map(r, out))


def side_by_side(out: Console, *panels: tuple[str, Table]) -> None:
    """Titled tables next to each other, or one under the other when together they are too wide."""
    grid = Table.grid(padding=(0, 4))
    grid.add_row(*(Text(title, style="bold") for title, _ in panels))
    grid.add_row(*(table for _, table in panels))
    if out.measure(grid, options=out.options.update_width(10_000)).maximum <= out.width:
        out.print(grid)
        return
    for i, (title, table) in enumerate(panels):
        if i:
            out.print()
        out.print(Text(title, style="bold"))
        out.print(table)


def window_line(w: dict[str, Any]) -> str:
    kept = w["sink_positions"]
    sinks = f"sinks {kept[0]}..{kept[-1]}" if kept else "no sinks"
    window = "..".join(map(str, w["window_positions"])) or "nothing"
    return (f"{sinks} + positions {window} ({w['positions']} positions): {w['held']} of {w['rows']} rows "
            f"per layer, {w['evicted_tokens']:,} evicted")


def pool_view(r: dict[str, Any]) -> Table:
    """The block pool of a paged cache: each sequence's block table, shared blocks, free blocks, fill."""
    refs, bs = r["refcounts"], r["block_size"]
    held = r["pool_blocks"] - len(r["free_blocks"])
    title = f"block pool: {r['pool_blocks']} blocks of {bs} tokens ({fmt_bytes(r['block_bytes'])} each)"
    table = Table(title=title, title_justify="left", title_style="bold", box=None, padding=(0, 2),
                  show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for seq in r["blocks"]:
        cells = " ".join(f"{b}(x{refs[b]})" if refs[b] > 1 else f"{b}" for b in seq["table"])
        table.add_row(f"seq {seq['sequence']}", f"{seq['length']} tokens in blocks {cells or '-'}")
    shared = ", ".join(f"{block} x{refs[block]}" for block in r["shared_blocks"]) or "none"
    used, allocated = r["slots_used"], r["slots_allocated"]
    table.add_row("shared", shared)
    free = r["free_blocks"]
    table.add_row("free", f"{len(free)} blocks" + (f": {compact(free)}" if free else ""))
    table.add_row("held", f"{held} blocks, {fmt_bytes(r['bytes_held'])} of {fmt_bytes(r['pool_bytes'])}; "
                          f"{r['tokens_held']} sequence positions in {used} written slots")
    table.add_row("fragmentation", f"{used} of {allocated} allocated slots used, "
                                   f"{allocated - used} empty ({(allocated - used) / (allocated or 1):.0%})")
    return table


def compact(numbers: list[int]) -> str:
    """Sorted whole numbers as ranges: 3-7, 9."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def token_line(tokens: list[dict[str, Any]]) -> Text:
    """pos:token for every cached token, whitespace made visible; ids when there is no tokenizer."""
    line = Text()
    for token in tokens:
        line.append(f"{token['pos']}:", style="dim")
        line.append(visible(token["text"]) if "text" in token else str(token["id"]))
        line.append(" ")
    return line


def visible(text: str) -> str:
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")


def attention_map(r: dict[str, Any], out: Console) -> Table:
    """One row per query head, one column per position; turned on its side when it is too wide."""
    percent = np.array(r["attention"]["weights"]) * 100
    group = r["heads"] // r["kv_heads"]
    heads = [f"q{h} (kv{h // group})" for h in range(r["heads"])]
    labels = [token_label(t) for t in r["tokens"]]
    at = [t["pos"] for t in r["tokens"]]
    table = heatmap(percent, heads, [f"{n}\n{label}" for n, label in zip(at, labels, strict=True)], "{:3.0f}")
    if out.measure(table, options=out.options.update_width(10_000)).maximum > out.width:
        rows = [f"{n:>4} {label}" for n, label in zip(at, labels, strict=True)]
        table = heatmap(percent.T, rows, [f"q{h}" for h in range(r["heads"])], "{:3.0f}")
    return table


def token_label(token: dict[str, Any]) -> str:
    return visible(token["text"])[:LABEL_CHARS] if "text" in token else str(token["id"])


def heatmap(values: np.ndarray, rows: list[str], columns: list[str], fmt: str) -> Table:
    """A table whose cells are coloured from the lowest value (dark) to the highest (bright)."""
    lo, hi = float(values.min()), float(values.max())
    span = hi - lo or 1.0
    table = Table(box=None, padding=(0, 0, 0, 1), header_style="bold")
    table.add_column(justify="left", no_wrap=True)
    for column in columns:  # Text, not markup: labels hold token text such as "[/"
        table.add_column(Text(column), justify="right", no_wrap=True)
    for label, row in zip(rows, values, strict=True):
        table.add_row(Text(label), *(Text(f" {fmt.format(v)} ", style=shade((v - lo) / span)) for v in row))
    return table


def shade(fraction: float) -> str:
    """The rich style of a value at `fraction` (0..1) of its heatmap's range."""
    x = min(max(fraction, 0.0), 1.0) * (len(RAMP) - 1)
    i = min(int(x), len(RAMP) - 2)
    r, g, b = (round(a + (b - a) * (x - i)) for a, b in zip(RAMP[i], RAMP[i + 1], strict=True))
    return f"{'black' if fraction > 0.55 else 'white'} on rgb({r},{g},{b})"


def main() -> None:
    run(command, PROG)


entry = script(main)  # the console script

if __name__ == "__main__":
    entry()
