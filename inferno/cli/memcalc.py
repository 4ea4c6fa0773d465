"""`kv-memcalc`: how much memory a KV cache needs, and what fits in a budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich import box
from rich.table import Table
from rich.text import Text

from inferno.cli.common import console, run, script, version_option
from inferno.errors import InfernoError
from inferno.file.hparams import MAX_LAYERS
from inferno.plan.deploy import devices
from inferno.plan.hf_config import read_hf_config
from inferno.plan.memcalc import (
    DTYPES,
    check_digits,
    default_contexts,
    heads_by_layer,
    kv_heads_by_layer,
    parse_contexts,
    parse_size,
    resolve_shape,
)
from inferno.plan.report import (
    DECIMAL,
    WEIGHT_BITS,
    build_deployment,
    build_report,
    deployment_weights,
    human,
    read_model,
    runtime_bytes,
)

PROG = "kv-memcalc"


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
            if isinstance(value, str):
                check_digits(value.strip().lstrip("+"), "value")
        except InfernoError as exc:
            self.fail(str(exc), param, ctx)
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




class Fraction(click.ParamType):
    name = "F"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            return float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "model_path", metavar="FILE.gguf", help="Read the shape from a GGUF's metadata.")
@click.option("--config", "config_path", metavar="FILE", help="Read the shape from a HF config.json.")
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
@click.option("--kv", "kv_kind", metavar="KIND",
              help="Size what inferno allocates for this cache layout (with --model): its exact bytes.")
@click.option("--kv-dtype", metavar="TYPE", help="Element type of that cache's rows (default: f32).")
@click.option("--sliding-window", type=POSITIVE, metavar="TOKENS", help="Most tokens a sliding layer holds.")
@click.option("--sliding-layers", metavar="LIST", help="Which layers slide: 0-4,6-10 (0-based) or all.")
@click.option(
    "--sliding-pattern",
    type=POSITIVE,
    metavar="N",
    help="Every Nth layer is global, the rest slide (Gemma 3: 6); 1 = none slide.",
)
@click.option("--budget", metavar="SIZE", help="Memory to fit: 24GiB, 32GB, 512MiB or bytes.")
@click.option("--gpus", metavar="NxSIZE", help="Plan a deployment on N GPUs of SIZE each: 4x80GiB.")
@click.option("--gpu-memory", metavar="SIZE", help="Memory of each GPU, with --tp/--pp saying how many.")
@click.option("--tp", type=POSITIVE, help="Tensor-parallel ranks  [default: every GPU of --gpus]")
@click.option("--pp", type=POSITIVE, help="Pipeline-parallel stages  [default: 1]")
@click.option(
    "--gpu-memory-utilization",
    "utilization",
    type=Fraction(),
    default=0.9,
    show_default=True,
    help="Fraction of each GPU the engine may use (vLLM's default).",
)
@click.option("--block-size", type=POSITIVE, default=16, show_default=True, help="Tokens per cache block.")
@click.option(
    "--overhead",
    metavar="SIZE",
    help="Per GPU for activations and CUDA graphs (vLLM logs it as the non-KV peak beyond the weights)"
    "  [default: none]",
)
@click.option(
    "--weight-dtype",
    type=click.Choice(list(WEIGHT_BITS), case_sensitive=False),
    help="Weight type for a config's parameters  [default: the config's torch_dtype or quantization]",
)
@click.option("--weights", "weights_size", metavar="SIZE", help="Total weight bytes: skip counting.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@version_option()
def command(
    model_path: str | None,
    config_path: str | None,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    heads: int | None,
    contexts: tuple[str, ...],
    batch: int,
    dtype: str,
    kv_kind: str | None,
    kv_dtype: str | None,
    sliding_window: int | None,
    sliding_layers: str | None,
    sliding_pattern: int | None,
    budget: str | None,
    gpus: str | None,
    gpu_memory: str | None,
    tp: int | None,
    pp: int | None,
    utilization: float,
    block_size: int,
    overhead: str | None,
    weight_dtype: str | None,
    weights_size: str | None,
    as_json: bool,
) -> None:
    """Size a KV cache: bytes per token, and in total for each context.

    \b
    Give the shape by hand:   kv-memcalc --layers 64 --kv-heads 8
    or read it from a model:  kv-memcalc --model model.gguf   (flags override it)
    or from its config.json:  kv-memcalc --config config.json
    and plan a deployment:    kv-memcalc --config config.json --gpus 4x80GiB --context 8k
    """
    if model_path and config_path:
        raise InfernoError("give --model FILE.gguf or --config config.json, not both")
    model = weights = hf = None
    if model_path:
        model, weights = read_model(model_path)
    elif config_path:
        hf = read_hf_config(config_path)
        model = hf.info
    deploying = gpus is not None or gpu_memory is not None
    if not deploying:
        needs_gpus = {"--tp": tp, "--pp": pp, "--weights": weights_size, "--weight-dtype": weight_dtype,
                      "--overhead": overhead}  # fmt: skip
        for flag, value in needs_gpus.items():
            if value is not None:
                raise InfernoError(f"{flag} plans a deployment: give --gpus (e.g. 4x80GiB) too")
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
    # Query heads from a file are worth comparing only when the model actually groups them;
    # MLA's one latent row is not K and V per head, so the comparison does not apply to it.
    grouped = heads is not None or heads_by_layer(shape) != kv_heads_by_layer(shape)
    show_mha = not shape.mla and shape.heads > 0 and grouped  # 0: query heads not known
    report = build_report(shape, kv_type, context_list, batch, budget_bytes, show_mha)
    if kv_kind is not None or kv_dtype is not None:
        runtime_bytes(report, model_path, kv_kind or "prealloc", kv_dtype or "f32", sliding_window)
    length = model.context_length if model is not None else None
    if length and report.get("max_context") is not None and report["max_context"] > length:
        # the budget would hold more, but the model cannot attend past its own context
        report["max_context_budget"] = report["max_context"]
        report["max_context"] = length
    if model is not None:
        report["model"] = {
            "file": Path(model_path or config_path).name,
            "arch": model.arch,
            "context_length": model.context_length,
        }
    if deploying:
        reserve = parse_size(overhead) if overhead is not None else 0
        dev = devices(gpus, gpu_memory, tp, pp, utilization, reserve, block_size)
        weights = deployment_weights(weights, hf, weight_dtype, weights_size, shape.layers)
        report["deployment"] = build_deployment(shape, kv_type, weights, dev, max(context_list), model_path,
                                                length)
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
        if "deployment" in report:
            print_deployment(report["deployment"])


def print_report(r: dict[str, Any]) -> None:
    out = console()
    if "model" in r:
        m = r["model"]
        length = f", context length {m['context_length']:,}" if m["context_length"] else ""
        out.print(Text(f"{m['file']}: {m['arch']}{length}"))
    if r.get("mla"):
        geometry = f"one MLA latent of {r['head_dim']} values"
    else:
        geometry = f"{_range_label(r['kv_heads'])} KV heads x head dim {r['head_dim']}"
    out.print(Text(f"KV cache of {r['layers']} layers x {geometry}, {r['dtype']}, batch {r['batch']}"))
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
            if "max_context_budget" in r:
                fits += f" (the model's limit; the budget: {r['max_context_budget']:,})"
        out.print(Text(f"  longest context at batch {r['batch']}: {fits}"))
        context = max(row["context"] for row in r["rows"])
        batch = r["max_batch"]
        verdict = "" if batch else " (does not fit)"
        out.print(Text(f"  largest batch at {context:,} tokens: {batch:,}{verdict}"))


def print_deployment(d: dict[str, Any]) -> None:
    out = console()
    lines = [
        f"deployment: {d['gpus']} x {human(d['gpu_memory'])} GPUs, tensor parallel {d['tp']}, "
        f"pipeline {d['pp']}, utilization {d['gpu_memory_utilization']:g}",
        f"  all weights      {both(d['weight_bytes'])}",
    ]
    if d["pp"] > 1:
        for n, stage in enumerate(d["stages"]):
            first, stop = stage["layers"]
            lines.append(
                f"  stage {n}: layers {first}-{stop - 1}, weights {human(stage['weight_bytes'])}, "
                f"{stage['blocks']:,} blocks"
            )
    g = d["per_gpu"]
    block_bytes = d["block_size"] * g["kv_bytes_per_token"]
    longest = "any" if g["max_context"] is None else f"{g['max_context']:,} tokens"
    batch = g["max_batch"]
    lines += [
        "per GPU" + (" (the stage that holds least)" if d["pp"] > 1 else ""),
        f"  weights          {both(g['weight_bytes'])}",
        f"  KV per token     {g['kv_bytes_per_token']:,} B ({human(g['kv_bytes_per_token'])})",
        f"  left for cache   {both(g['cache_bytes'])}",
        f"  blocks           {g['blocks']:,} of {d['block_size']} tokens ({human(block_bytes)} each)",
        f"  longest context  {longest} at batch 1",
        f"  largest batch    {batch:,} at {d['context']:,} tokens" + ("" if batch else " (does not fit)"),
    ]
    if d["overhead"] == 0:
        lines.append("  (activations and CUDA graphs not reserved: see --overhead)")
    engines = d["engines"]
    for name, title in (("vllm", "vLLM"), ("sglang", "SGLang"), ("llama.cpp", "llama.cpp")):
        if name not in engines:
            continue
        lines.append(title)
        lines += _command_lines(engines[name]["args"])
        e = engines[name]
        if e.get("num_gpu_blocks") is not None:
            tokens, blocks = e["kv_cache_tokens"], e["num_gpu_blocks"]
            lines.append(f"  logs: GPU KV cache size: {tokens:,} tokens ({blocks:,} blocks);")
            context, concurrency = d["context"], e["max_concurrency"]
            per_request = f"Maximum concurrency for {context:,} tokens per request: {concurrency:.2f}x"
            lines.append(f"        {per_request}")
        elif name == "vllm":
            lines.append("  block count not modelled: vLLM pages sliding and full layers in groups")
        if e.get("max_total_num_tokens") is not None:
            lines.append(f"  logs: max_total_num_tokens={e['max_total_num_tokens']}")
    for line in lines:
        out.print(Text(line))


def _command_lines(args: list[str], width: int = 78) -> list[str]:
    """A shell command wrapped with backslashes, flags kept with their values."""
    words = [args[0]]
    for arg in args[1:]:
        if words[-1].startswith("-") and not arg.startswith("-") and " " not in words[-1]:
            words[-1] += f" {arg}"
        else:
            words.append(arg)
    lines, line = [], "  " + words[0]
    for word in words[1:]:
        if len(line) + len(word) + 3 > width:
            lines.append(line + " \\")
            line = "      " + word
        else:
            line += " " + word
    return [*lines, line]


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


entry = script(main)  # the console script

if __name__ == "__main__":
    entry()
