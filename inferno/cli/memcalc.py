"""`kv-memcalc`: how much memory a KV cache needs, and what fits in a budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich import box
from rich.table import Table
from rich.text import Text

from inferno.cli.common import console, run, version_option
from inferno.errors import InfernoError
from inferno.memcalc import (
    DTYPES,
    MAX_LAYERS,
    DType,
    KVShape,
    ModelInfo,
    bytes_per_token,
    bytes_per_token_beyond_window,
    cache_bytes,
    default_contexts,
    layer_token_bytes,
    max_batch,
    max_context,
    model_info,
    parse_contexts,
    parse_size,
    resolve_shape,
)

PROG = "kv-memcalc"
BINARY = (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
DECIMAL = (("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def human(n: int, units: tuple[tuple[str, int], ...] = BINARY) -> str:
    for name, size in units:
        if n >= size:
            return f"{n / size:.2f} {name}"
    return f"{n} B"


def both(n: int) -> str:
    """Binary and decimal side by side, so 31.25 GiB is never mistaken for 31.25 GB."""
    return f"{human(n)} / {human(n, DECIMAL)}"


class PositiveInt(click.ParamType):
    """A whole number of at least 1 (and at most `maximum`), with a plainer message than click's IntRange."""

    name = "N"

    def __init__(self, maximum: int | None = None) -> None:
        self.maximum = maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            number = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a whole number", param, ctx)
        if number < 1:
            self.fail(f"must be at least 1, got {number}", param, ctx)
        if self.maximum is not None and number > self.maximum:
            self.fail(f"must be at most {self.maximum:,}, got {number:,}", param, ctx)
        return number


POSITIVE = PositiveInt()


def read_model(path: str) -> ModelInfo:
    # Imported here so sizing by flags alone starts without loading the GGUF reader.
    from inferno.gguf_file import metadata, open_gguf

    reader = open_gguf(path)

    def get(key: str) -> Any:
        # Every key model_info reads is a count (or one per layer) but the architecture's name.
        value = metadata(reader, key)
        if isinstance(value, (str, float)) and key != "general.architecture":
            raise InfernoError(f"GGUF metadata {key} should be an integer, not {value!r}"[:160])
        return value

    return model_info(get)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "model_path", metavar="FILE.gguf", help="Read the shape from a GGUF's metadata.")
@click.option("--layers", type=PositiveInt(MAX_LAYERS), help="Transformer layers (blocks).")
@click.option("--kv-heads", type=POSITIVE, help="Key/value heads per layer.")
@click.option("--head-dim", type=POSITIVE, help="Values per head  [default: 128, or the model's]")
@click.option("--heads", type=POSITIVE, help="Query heads: also show what multi-head attention would need.")
@click.option(
    "--context",
    "contexts",
    multiple=True,
    metavar="N",
    help="Tokens per sequence: 4096, 128k (=131072), 2k,4k or repeat the flag  [default: 2k to 128k]",
)
@click.option("--batch", type=POSITIVE, default=1, show_default=True, help="Sequences held at once.")
@click.option(
    "--dtype",
    type=click.Choice(list(DTYPES), case_sensitive=False),
    default="f16",
    show_default=True,
    help="Element type of the cache; q8_0 and q4_0 count their scales.",
)
@click.option("--sliding-window", type=POSITIVE, metavar="TOKENS", help="Most tokens a sliding layer holds.")
@click.option("--sliding-layers", metavar="LIST", help="Which layers slide: 0-4,6-10 (0-based) or all.")
@click.option(
    "--sliding-pattern",
    type=POSITIVE,
    metavar="N",
    help="Every Nth layer is global, the rest slide (Gemma 3: 6); 1 = none slide.",
)
@click.option("--budget", metavar="SIZE", help="Memory to fit: 24GiB, 32GB, 512MiB or bytes.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@version_option()
def command(
    model_path: str | None,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    heads: int | None,
    contexts: tuple[str, ...],
    batch: int,
    dtype: str,
    sliding_window: int | None,
    sliding_layers: str | None,
    sliding_pattern: int | None,
    budget: str | None,
    as_json: bool,
) -> None:
    """Size a KV cache: bytes per token, and in total for each context.

    \b
    Give the shape by hand:   kv-memcalc --layers 64 --kv-heads 8
    or read it from a model:  kv-memcalc --model model.gguf   (flags override it)
    """
    model = read_model(model_path) if model_path else None
    budget_bytes = parse_size(budget) if budget is not None else None
    context_list = (
        parse_contexts(contexts) if contexts else default_contexts(model.context_length if model else None)
    )
    shape = resolve_shape(
        model,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        heads=heads,
        window=sliding_window,
        sliding_layers=sliding_layers,
        sliding_pattern=sliding_pattern,
    )
    kv_type = DTYPES[dtype.lower()]
    # Query heads from a file are worth comparing only when the model actually groups them.
    show_mha = shape.heads is not None and (heads is not None or shape.heads != shape.kv_heads)
    report = build_report(shape, kv_type, context_list, batch, budget_bytes, show_mha)
    if model is not None:
        report["model"] = {
            "file": Path(model_path).name,
            "arch": model.arch,
            "context_length": model.context_length,
        }
    chose_layers = sliding_layers is not None or sliding_pattern is not None
    if model is not None and model.window and model.sliding is None and not chose_layers:
        click.echo(
            f"{PROG}: note: the model has a {model.window}-token sliding window but does not say which "
            "layers use it; counting every layer as full (see --sliding-layers)",
            err=True,
        )
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_report(report)


def build_report(
    shape: KVShape,
    dtype: DType,
    contexts: list[int],
    batch: int,
    budget: int | None,
    show_mha: bool,
) -> dict[str, Any]:
    """Everything kv-memcalc says, as plain data: printed as JSON or rendered as text."""
    per_layer = layer_token_bytes(shape, dtype)
    report: dict[str, Any] = {
        "layers": shape.layers,
        "kv_heads": _scalar(shape.kv_heads),
        "head_dim": shape.head_dim,
        "dtype": dtype.name,
        "batch": batch,
        "bytes_per_token": bytes_per_token(shape, dtype),
        "bytes_per_token_per_layer": _scalar(tuple(per_layer)),
    }
    if shape.sliding:
        report["sliding_window"] = shape.window
        report["sliding_layers"] = sorted(shape.sliding)
        report["bytes_per_token_beyond_window"] = bytes_per_token_beyond_window(shape, dtype)
    if show_mha:
        report["heads"] = _scalar(shape.heads)
        report["mha_bytes_per_token"] = bytes_per_token(shape, dtype, mha=True)
    rows = []
    for context in contexts:
        row = {"context": context, "batch": batch, "dtype": dtype.name}
        row["bytes"] = cache_bytes(shape, dtype, context, batch)
        if show_mha:
            row["mha_bytes"] = cache_bytes(shape, dtype, context, batch, mha=True)
        if budget is not None:
            row["max_batch"] = max_batch(shape, dtype, budget, context)
        rows.append(row)
    report["rows"] = rows
    if budget is not None:
        report["budget"] = budget
        report["max_context"] = max_context(shape, dtype, budget, batch)
        # The batch that fits every context asked about: the one at the longest context.
        report["max_batch"] = min(row["max_batch"] for row in rows)
    return report


def _scalar(values: tuple[int, ...]) -> int | list[int]:
    return values[0] if len(set(values)) == 1 else list(values)


def print_report(r: dict[str, Any]) -> None:
    out = console()
    if "model" in r:
        m = r["model"]
        length = f", context length {m['context_length']:,}" if m["context_length"] else ""
        out.print(Text(f"{m['file']}: {m['arch']}{length}"))
    kv = _range_label(r["kv_heads"])
    out.print(
        Text(
            f"KV cache of {r['layers']} layers x {kv} KV heads x head dim {r['head_dim']}, "
            f"{r['dtype']}, batch {r['batch']}"
        )
    )
    per_layer = r["bytes_per_token_per_layer"]
    if isinstance(per_layer, int):
        layer_text = f"{per_layer:,} B per layer"
    else:
        layer_text = f"{min(per_layer):,} to {max(per_layer):,} B per layer"
    total = r["bytes_per_token"]
    out.print(Text(f"per token: {layer_text}, {total:,} B ({both(total)}) in all"))
    if "sliding_window" in r:
        full = r["layers"] - len(r["sliding_layers"])
        beyond = r["bytes_per_token_beyond_window"]
        out.print(
            Text(
                f"sliding window: {len(r['sliding_layers'])} of {r['layers']} layers hold at most "
                f"{r['sliding_window']:,} tokens"
            )
        )
        out.print(Text(f"past it, a token adds {beyond:,} B ({both(beyond)}) to the {full} full layers"))

    columns = {"Context": [f"{row['context']:,}" for row in r["rows"]]}
    columns["Bytes"] = [f"{row['bytes']:,}" for row in r["rows"]]
    columns["KV cache"] = [both(row["bytes"]) for row in r["rows"]]
    if "heads" in r:
        columns[f"MHA ({_range_label(r['heads'])} heads)"] = [both(row["mha_bytes"]) for row in r["rows"]]
    if "budget" in r:
        columns["Max batch"] = [f"{row['max_batch']:,}" for row in r["rows"]]
    table = _table(columns)
    unclamped = out.options.update_width(10_000)  # measure() otherwise caps the answer at the width
    if out.measure(table, options=unclamped).maximum > out.width:
        # Exact bytes are the first thing to give up: the per-token line and --json still have them.
        del columns["Bytes"]
        table = _table(columns)
    out.print(table)

    if "heads" in r:
        gqa, mha = r["bytes_per_token"], r["mha_bytes_per_token"]
        out.print(
            Text(
                f"multi-head attention stores {mha / gqa:.2f}x as much per token; "
                f"grouped-query saves {1 - gqa / mha:.1%}"
            )
        )
    if "budget" in r:
        out.print(Text(f"budget {both(r['budget'])}:"))
        longest = r["max_context"]
        if longest is None:
            fits = "any (only sliding layers hold a cache)"
        else:
            fits = f"{longest:,} tokens"
            length = r.get("model", {}).get("context_length")
            if length and longest > length:
                fits += f" (past the model's {length:,})"
        out.print(Text(f"  longest context at batch {r['batch']}: {fits}"))
        context = max(row["context"] for row in r["rows"])
        batch = r["max_batch"]
        verdict = "" if batch else " (does not fit)"
        out.print(Text(f"  largest batch at {context:,} tokens: {batch:,}{verdict}"))


def _table(columns: dict[str, list[str]]) -> Table:
    table = Table(
        box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1), header_style="bold"
    )
    for header in columns:
        table.add_column(header, justify="right", no_wrap=True)
    for cells in zip(*columns.values(), strict=True):
        table.add_row(*cells)
    return table


def _range_label(counts: int | list[int]) -> str:
    """One head count, or the range when layers differ."""
    return str(counts) if isinstance(counts, int) else f"{min(counts)}-{max(counts)}"


def main() -> None:
    run(command, PROG)


if __name__ == "__main__":
    main()
