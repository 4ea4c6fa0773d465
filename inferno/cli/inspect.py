"""`kv-inspect [MODEL.gguf] PROMPT` or `kv-inspect SNAPSHOT`: look inside a KV cache.

Runs the prompt (and --decode N greedy tokens) into a prealloc cache, or reads a saved snapshot, and
shows the cache's geometry, how full it is, the tokens it holds, the mean L2 norm of K and V per layer
and KV head, and with --layer L what the last query of that layer attends to.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from inferno.cli.common import (
    blame,
    console,
    default_model,
    is_gguf_file,
    looks_like_model,
    progress_on,
    run,
    set_threads,
    utf8,
    version_option,
)
from inferno.cli.display import fmt_bytes
from inferno.errors import InfernoError
from inferno.kv import KVCache, KVGeometry
from inferno.snapshot import Snapshot
from inferno.validate import check_logits, refusing_non_finite

if TYPE_CHECKING:
    from inferno.engine import Engine  # loading it pulls in the model and its kernels

PROG = "kv-inspect"
# Plasma, dark to bright: a sequential scale that stays readable where colour is scarce.
RAMP = ((13, 8, 135), (126, 3, 168), (204, 71, 120), (248, 149, 64), (240, 249, 33))
LABEL_CHARS = 10  # of a token's text in a column header


def is_snapshot_file(arg: str) -> bool:
    """A .safetensors name, or a file that is not a GGUF: read as a snapshot (which says if it is not one)."""
    if arg.endswith(".safetensors"):
        return True
    return not arg.endswith(".gguf") and os.path.isfile(arg) and not is_gguf_file(arg)


def fill_cache(
    engine: Engine, prompt_ids: Sequence[int], n_decode: int, max_context: int | None
) -> tuple[KVCache, list[int], list[np.ndarray]]:
    """Run the prompt and n_decode greedy tokens into a prealloc cache: (cache, token ids, queries).

    The last token goes through decode, which hands over each layer's query row after RoPE.
    """
    with blame("--max-context", max_context):
        cache = engine.make_cache("prealloc", len(prompt_ids), n_decode, max_context)
    model, ids = engine.model, list(prompt_ids)
    with refusing_non_finite(len(ids) - 1):
        if len(ids) > 1:
            model.prefill(np.array(ids[:-1]), cache)
    queries: list[np.ndarray] = []
    for step in range(n_decode + 1):
        last = step == n_decode
        with refusing_non_finite(len(ids) - 1):
            logits = model.decode(ids[-1], len(ids) - 1, cache, queries=queries if last else None)
        check_logits(logits, len(ids) - 1)
        if not last:
            ids.append(int(np.argmax(logits)))  # greedy
    return cache, ids, queries


def mean_norms(rows: np.ndarray, kv_heads: int) -> list[list[float]]:
    """Mean over positions of each KV head's L2 norm: [layers, length, kv_width] -> [layers][kv_heads]."""
    layers, length, width = rows.shape
    heads = rows.reshape(layers, length, kv_heads, width // kv_heads).astype(np.float64)
    return np.linalg.norm(heads, axis=-1).mean(axis=1).tolist()


def attention_weights(query: np.ndarray, keys: np.ndarray, geometry: KVGeometry) -> np.ndarray:
    """softmax(q . k / sqrt(head_dim)) of each query head over all positions: [heads, length].

    Query head h reads KV head h // (heads / kv_heads), as grouped-query attention does.
    """
    g = geometry
    q = query.reshape(g.kv_heads, g.heads // g.kv_heads, g.head_dim).astype(np.float64)
    k = keys.reshape(-1, g.kv_heads, g.head_dim).astype(np.float64)
    scores = np.einsum("hgd,shd->hgs", q, k).reshape(g.heads, -1) / np.sqrt(g.head_dim)
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True)


def build_report(
    snapshot: Snapshot, capacity: int, bytes_allocated: int, texts: list[str] | None
) -> dict[str, Any]:
    """Everything kv-inspect shows about a cache's contents, as plain data (the --json output)."""
    g = snapshot.geometry
    tokens = [{"pos": pos, "id": int(token_id)} for pos, token_id in enumerate(snapshot.token_ids)]
    if texts is not None:
        for token, text in zip(tokens, texts, strict=True):
            token["text"] = text
    return {
        "architecture": snapshot.architecture,
        "fingerprint": snapshot.fingerprint,
        "layers": g.layers,
        "kv_heads": g.kv_heads,
        "heads": g.heads,
        "head_dim": g.head_dim,
        "kv_width": g.kv_width,
        "dtype": str(snapshot.keys.dtype),
        "k_after_rope": True,
        "length": snapshot.length,
        "capacity": capacity,
        "bytes_per_token": g.nbytes(1, snapshot.keys.itemsize),
        "bytes_used": snapshot.nbytes,
        "bytes_allocated": bytes_allocated,
        "tokens": tokens,
        "key_norms": mean_norms(snapshot.keys, g.kv_heads),
        "value_norms": mean_norms(snapshot.values, g.kv_heads),
    }


def inspect_model(
    model_path: Path,
    prompt: str,
    n_decode: int,
    layer: int | None,
    max_context: int | None,
    status: Console | None,
) -> dict[str, Any]:
    """Load the model, fill a cache with the prompt and report on it (status: where to show progress)."""
    from inferno.engine import Engine

    engine = Engine.load(model_path, progress=progress_on(status))
    layers = engine.config.n_layers
    if layer is not None and not 0 <= layer < layers:
        raise InfernoError(f"--layer {layer} does not exist: the model has layers 0..{layers - 1}")
    tok = engine.tokenizer
    cache, ids, queries = fill_cache(engine, tok.encode(prompt), n_decode, max_context)
    snapshot = Snapshot.from_cache(cache, ids, engine.config, engine.fingerprint)
    texts = [tok.token_text(token_id) for token_id in ids]
    report = {"model": str(model_path), "cache": cache.kind}
    report |= build_report(snapshot, cache.capacity, cache.nbytes, texts)
    if layer is not None:
        keys, _ = cache.read(layer)
        weights = attention_weights(queries[layer], keys, snapshot.geometry)
        report["attention"] = {"layer": layer, "query_pos": len(ids) - 1, "weights": weights.tolist()}
    return report


def split_args(args: tuple[str, ...]) -> tuple[Path | None, str]:
    """[MODEL.gguf] PROMPT."""
    if not args or (len(args) == 1 and looks_like_model(args[0])):
        raise click.UsageError("missing PROMPT (or a snapshot file to inspect)")
    if len(args) > 2:
        raise click.UsageError(f"too many arguments: {' '.join(args[2:])}")
    model, prompt = (Path(args[0]), args[1]) if len(args) == 2 else (None, args[0])
    return model, utf8("the prompt", prompt)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("args", nargs=-1, metavar="[MODEL.gguf] PROMPT | SNAPSHOT")
@click.option("--decode", "n_decode", type=int, default=0, metavar="N",
              help="Decode N greedy tokens after the prompt.")
@click.option("--layer", type=int, default=None, metavar="L",
              help="Show the attention weights of the last query in layer L (0-based).")
@click.option("--max-context", type=int, default=None,
              help="Tokens the cache is sized for (default: prompt + --decode).")
@click.option("--threads", type=int, default=None, help="Threads for the kernels (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@version_option()
def command(args, n_decode, layer, max_context, threads, as_json):
    """Show what a KV cache holds: geometry, fill, tokens, K/V norms, attention.

    \b
    Run a prompt:        kv-inspect [MODEL.gguf] PROMPT [--decode N] [--layer L]
    Read a snapshot:     kv-inspect SNAPSHOT   (saved by model-generate --save-cache; no model needed)
    """
    if n_decode < 0:
        raise InfernoError(f"--decode must be 0 or more, got {n_decode}")
    if max_context is not None and max_context < 1:
        raise InfernoError(f"--max-context must be at least 1, got {max_context}")
    set_threads(threads)
    if len(args) == 1 and is_snapshot_file(args[0]):
        if n_decode or layer is not None or max_context is not None:
            raise InfernoError("--decode, --layer and --max-context need a model, not a snapshot")
        snapshot = Snapshot.load(args[0])
        report = {"snapshot": args[0]} | build_report(snapshot, snapshot.length, snapshot.nbytes, None)
    else:
        model_path, prompt = split_args(args)
        status = None if as_json else console(stderr=True)
        report = inspect_model(model_path or default_model(), prompt, n_decode, layer, max_context, status)
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
        ("keys", "stored after RoPE: a cached row never needs rotating again"),
        ("per token", f"{r['bytes_per_token']:,} B ({row_bytes:,} B x 2 x {r['layers']} layers)"),
        ("length", f"{r['length']:,} of {r['capacity']:,} tokens committed"),
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
    grid = Table.grid(padding=(0, 4))
    grid.add_row(Text("mean |K| per head", style="bold"), Text("mean |V| per head", style="bold"))
    grid.add_row(
        heatmap(np.array(r["key_norms"]), layers, kv_heads, "{:6.2f}"),
        heatmap(np.array(r["value_norms"]), layers, kv_heads, "{:6.2f}"),
    )
    out.print(grid)
    if "attention" in r:
        layer, pos = r["attention"]["layer"], r["attention"]["query_pos"]
        out.print()
        out.print(Text(f"layer {layer}: attention of the last query (position {pos}) over the cache, in %",
                       style="bold"))
        out.print(attention_map(r, out))


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
    table = heatmap(percent, heads, [f"{n}\n{label}" for n, label in enumerate(labels)], "{:3.0f}")
    if out.measure(table, options=out.options.update_width(10_000)).maximum > out.width:
        rows = [f"{n:>4} {label}" for n, label in enumerate(labels)]
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


if __name__ == "__main__":
    main()
