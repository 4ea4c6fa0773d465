"""`kv-bench`: one prompt generated with no cache and each cache layout (and element type), side by side
in one run; with `--fidelity`, what each element type costs in quality against the float cache; with
`--batch-sweep 1,2,4,8`, the prompt forked into B sequences decoded together, for each B."""

from __future__ import annotations

import json
import sys

import click

from inferno.bench.batch_sweep import batch_sweep, parse_sizes
from inferno.bench.kv_modes import DEFAULT_MODES, MODES, run_modes, summary_row
from inferno.cli.common import (
    TEXT_FILE_LIMIT,
    check_activations,
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
    utf8,
    version_option,
)
from inferno.errors import InfernoError
from inferno.kv import DEFAULT_DTYPE, DTYPES
from inferno.kv.pool import BLOCK_SIZE

PROG = "kv-bench"
FIDELITY_TOKENS = 1024


def split_list(value: str, valid, what: str) -> tuple[str, ...]:
    chosen = tuple(m.strip() for m in value.split(",") if m.strip())
    unknown = [m for m in chosen if m not in valid]
    if unknown or not chosen:
        raise InfernoError(f"unknown {what} {','.join(unknown) or '(none)'} (valid: {', '.join(valid)})")
    return chosen


def text_tokens(engine, text_file: str | None, tokens: int) -> tuple[list[int], str]:
    """`tokens` token ids of the fidelity text (the file's, or the default) and where the text is from."""
    from inferno.analysis.fidelity import default_text

    if text_file:
        text, source = read_text_file("--text-file", text_file, TEXT_FILE_LIMIT, "a text"), text_file
    else:
        text, source = default_text()
    ids = engine.tokenizer.encode(text)
    if len(ids) < tokens:
        raise InfernoError(f"the text has {len(ids)} tokens, fewer than --tokens {tokens}")
    return ids[:tokens], source


MAX_NEW_TOKENS = 2**24
MAX_SEQUENCES = 4096


def check_bounds(engine, depth: int | None, new_tokens: int, tokens: int | None, block_size: int | None,
                 batches: list[int]) -> None:
    """Flags against what the model's context and the machine's memory hold, before any work."""
    from inferno.cli.common import check_memory

    context = engine.config.context_length
    for flag, value in (("--depth", depth), ("--tokens", tokens), ("--block-size", block_size)):
        if value is not None and value > context:
            raise InfernoError(f"{flag} {value:,} is more than the model's context of {context:,} tokens")
    if new_tokens > MAX_NEW_TOKENS:
        raise InfernoError(f"--new-tokens {new_tokens:,} is more than the {MAX_NEW_TOKENS:,} a run can take")
    if batches:
        largest = max(batches)
        if largest > MAX_SEQUENCES:
            raise InfernoError(f"a batch of {largest:,} is more than the {MAX_SEQUENCES:,} sequences a run "
                               "decodes together")
        per_token = engine.config.kv_geometry.nbytes(1, 4)
        held = min((depth or 2000) + new_tokens, context) + (block_size or 16)
        check_memory(f"{largest:,} sequences of {held:,} tokens", largest * held * per_token)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", required=False, type=click.Path(dir_okay=True),
                metavar="[MODEL.gguf|smollm2|gemma3]")
@click.option("--prompt", default="Once upon a time", show_default=True)
@click.option("--depth", type=int, default=None, metavar="N",
              help="Instead of --prompt, an N-token prompt (the fidelity text, repeated): decode at depth N.")
@click.option("--new-tokens", "-n", type=int, default=128, show_default=True)
@click.option("--modes", default=",".join(DEFAULT_MODES), show_default=True,
              help=f"Comma-separated, of {', '.join(MODES)}.")
@click.option("--kv-dtype", "kv_dtypes", default=DEFAULT_DTYPE, show_default=True, metavar="LIST",
              help=f"Element types of the cache rows, comma-separated: {', '.join(DTYPES)}.")
@click.option("--fidelity", is_flag=True,
              help="Teacher-force a long text through the float cache and each --kv-dtype: top-1 agreement, "
                   "KL divergence, perplexity.")
@click.option("--text-file", type=click.Path(dir_okay=False), default=None,
              help="Text for --fidelity (default: the Python Language Reference's 'Execution model').")
@click.option("--tokens", type=int, default=FIDELITY_TOKENS, show_default=True,
              help="Tokens of the text --fidelity runs.")
@click.option("--average", type=int, default=32, show_default=True, metavar="N",
              help="Decode steps averaged for the first/last forward columns.")
@click.option("--window", "old_window", default=None, hidden=True)  # now --average: refused with a hint
@click.option("--batch-sweep", "sweep", default=None, metavar="B1,B2,...",
              help="Instead of the modes: for each B, B greedy sequences of the prompt decoded together in a "
                   "paged pool, its full blocks computed once (e.g. 1,2,4,8,16).")
@click.option("--block-size", type=int, default=BLOCK_SIZE, show_default=True,
              help="Tokens per block of the --batch-sweep pool.")
@click.option("--mixed-load", "mixed", default=None, metavar="B",
              help="Instead of the modes: B sequences decoding while a --depth prompt (default 2000 tokens) "
                   "arrives, with each --step-tokens budget (chunked prefill) and none, side by side.")
@click.option("--step-tokens", default="64,off", show_default=True, metavar="LIST",
              help="--mixed-load: tokens a step computes over all sequences, comma-separated (off: none).")
@click.option("--rounds", type=int, default=3, show_default=True,
              help="--mixed-load: rounds per budget; the median round (by ITL p99) is shown.")
@click.option("--activations", default="f32", show_default=True, metavar="f32|int8",
              help="How quantized weights take activations (--fidelity: the rows besides the reference's).")
@threads_option(measured=False)
@click.option("--json", "as_json", is_flag=True)
@click.option("--plot", type=click.Path(dir_okay=False), default=None, metavar="FILE.svg|FILE.png",
              help="Also draw the results (matplotlib) into FILE: SVG or PNG by its extension.")
@quiet_option()
@version_option()
def command(model, prompt, depth, new_tokens, modes, kv_dtypes, fidelity, text_file, tokens, average,
            old_window, sweep, block_size, mixed, step_tokens, rounds, activations, threads, as_json, plot,
            quiet):
    """Show what a KV cache buys: per-forward time climbs without one and stays flat with one.

    \b
    Speed:     kv-bench --modes prealloc --kv-dtype f32,q8_0,q4_0h --depth 2048 -n 64
    Fidelity:  kv-bench --fidelity --kv-dtype f16,q8_0,q8_0h,q4_recent  (--activations int8 --kv-dtype f32)
    Batching:  kv-bench --batch-sweep 1,2,4,8,16 --depth 128 -n 64
    Mixed:     kv-bench --mixed-load 7 --depth 2000 --step-tokens 64,off -n 64
    """
    if old_window is not None:
        raise InfernoError(f"kv-bench's --window is now --average {old_window} (decode steps averaged); "
                           "--window is a window cache's size everywhere else")
    if average < 1:
        raise InfernoError(f"--average must be at least 1, got {average}")
    if plot is not None:
        from inferno.analysis.plots import check_plot_file

        check_plot_file(plot)
    set_threads(threads, measured=False)
    chosen = split_list(modes, MODES, "mode")
    dtypes = split_list(kv_dtypes, DTYPES, "element type")
    if new_tokens < 2:
        raise InfernoError(f"--new-tokens must be at least 2, got {new_tokens}")
    if depth is not None and depth < 1:
        raise InfernoError(f"--depth must be at least 1, got {depth}")
    if tokens < 2:
        raise InfernoError(f"--tokens must be at least 2, got {tokens}")
    sizes = parse_sizes(sweep) if sweep is not None else None
    if sizes and fidelity:
        raise InfernoError("--batch-sweep and --fidelity do not go together: give one")
    if block_size < 1:
        raise InfernoError(f"--block-size must be at least 1, got {block_size}")
    decoders = parse_sizes(mixed)[0] if mixed is not None else None
    budgets = [None if b.strip() == "off" else parse_sizes(b)[0] for b in step_tokens.split(",")]
    if rounds < 1:
        raise InfernoError(f"--rounds must be at least 1, got {rounds}")
    if decoders and (sizes or fidelity):
        raise InfernoError("--mixed-load goes alone: not with --batch-sweep or --fidelity")
    check_activations(activations)
    from inferno.runtime.engine import Engine

    err = quiet_console(quiet, as_json)
    engine = Engine.load(model_file(model), progress=progress_on(err))
    check_bounds(engine, depth, new_tokens, tokens if fidelity else None, block_size if sizes else None,
                 [*(sizes or []), *([decoders] if decoders else [])])
    if fidelity:
        return report_fidelity(engine, dtypes, text_file, tokens, activations, as_json, plot, err)
    engine.model.set_activations(activations)
    if depth is not None:
        ids, _ = text_tokens(engine, text_file, 2)
        prompt_ids = (ids * (depth // len(ids) + 1))[:depth]
    else:
        prompt_ids = engine.tokenizer.encode(utf8("--prompt", prompt))
    if sizes:
        return report_sweep(engine, prompt_ids, new_tokens, sizes, block_size, as_json, plot)
    if decoders:
        ids, _ = text_tokens(engine, text_file, 2)
        long_ids = (ids * ((depth or 2000) // len(ids) + 1))[: depth or 2000]
        short_ids = engine.tokenizer.encode(utf8("--prompt", prompt))
        return report_mixed(engine, short_ids, long_ids, decoders, new_tokens, budgets, rounds, as_json, plot)
    results, kernels_ms = timed_modes(engine, prompt_ids, new_tokens, chosen, dtypes, err)
    rows = {mode: summary_row(r["metrics"], average) | {"kernels_ms": kernels_ms[mode]}
            for mode, r in results.items()}
    same = len({tuple(r["token_ids"]) for r in results.values()}) == 1
    report = {"prompt_tokens": len(prompt_ids), "new_tokens": new_tokens, "identical_tokens": same,
              "summary": rows, "runs": results}
    if emit(report, plot, as_json, "plot_forwards"):
        return
    from inferno.cli.display import bench_table, forward_chart

    out = console()
    out.print(bench_table(rows, len(prompt_ids), new_tokens, average))
    if depth is None:
        out.print(forward_chart({m: r["metrics"]["per_forward_ms"][1:] for m, r in results.items()},
                                width=min(72, out.width - 14)))
    out.print("same tokens from every mode" if same else "[yellow]the modes generated different tokens[/]")


def timed_modes(engine, prompt_ids: list[int], new_tokens: int, modes: tuple[str, ...],
                dtypes: tuple[str, ...], err) -> tuple[dict, dict]:
    """run_modes one mode and element type at a time (a spinner on `err` says which), and the
    milliseconds each spent loading or compiling kernels on its first use (`startup.jit_ms`), which
    its TTFT and decode figures leave out."""
    from contextlib import nullcontext

    from inferno.kv import LAYOUTS

    results, kernels_ms = {}, {}
    for mode in modes:
        for dtype in (dtypes[0],) if mode == "off" else [d for d in dtypes if d in LAYOUTS[mode].dtypes]:
            label = mode if mode == "off" or dtypes == (DEFAULT_DTYPE,) else f"{mode}/{dtype}"
            before = engine.startup.jit_ms
            with err.status(f"{label}: {new_tokens} tokens") if err is not None else nullcontext():
                (run_,) = run_modes(engine, prompt_ids, new_tokens, (mode,), (dtype,)).values()
            results[label] = run_
            kernels_ms[label] = engine.startup.jit_ms - before
    return results, kernels_ms


def report_fidelity(engine, dtypes: tuple[str, ...], text_file: str | None, tokens: int, activations: str,
                    as_json: bool, plot: str | None = None, err=None) -> None:
    from inferno.analysis.fidelity import measure
    from inferno.cli.display import Counted, counting

    ids, source = text_tokens(engine, text_file, tokens)
    kernels_ms = warm_dtypes(engine, dtypes, activations)
    runs = 1 + sum(d != DEFAULT_DTYPE or activations != "f32" for d in dtypes)  # measure's rows
    with counting(err, runs * (len(ids) - 1), f"{runs} element types: decodes") as advance:
        rows = measure(Counted(engine.model, "decode", advance), ids, list(dtypes), activations=activations)
    report = {"text": source, "tokens": len(ids),
              "rows": [r.to_json() | {"kernels_ms": kernels_ms.get(r.dtype, 0.0)} for r in rows]}
    if emit(report, plot, as_json, "plot_fidelity"):
        return
    from inferno.cli.display import fidelity_table

    console().print(fidelity_table(report["rows"], source, len(ids)))


def warm_dtypes(engine, dtypes: tuple[str, ...], activations: str) -> dict[str, float]:
    """Load (or compile) each element type's kernels before the timed run, so its decode ms is work:
    the milliseconds each took (0 when loaded already)."""
    spent = {}
    before = engine.model.activations
    try:
        engine.model.set_activations(activations)
        for dtype in dict.fromkeys(dtypes):
            t = engine.startup.jit_ms
            engine.make_cache("prealloc", 1, 1, dtype=dtype)
            spent[dtype] = engine.startup.jit_ms - t
    finally:
        engine.model.set_activations(before)
    return spent


def report_sweep(engine, prompt_ids: list[int], new_tokens: int, sizes: list[int], block_size: int,
                 as_json: bool, plot: str | None = None) -> None:
    rows = batch_sweep(engine, prompt_ids, new_tokens, sizes, block_size)
    report = {"prompt_tokens": len(prompt_ids), "new_tokens": new_tokens, "block_size": block_size,
              "activations": engine.model.activations, "sweep": rows}
    if emit(report, plot, as_json, "plot_sweep"):
        return
    from inferno.cli.display import sweep_table

    out = console()
    out.print(sweep_table(rows, len(prompt_ids), new_tokens, block_size, engine.model.activations))
    same = all(r["identical_tokens"] for r in rows)
    out.print("every sequence of every batch generated the same tokens" if same
              else "[bold red]sequences of one batch generated different tokens[/]")


def report_mixed(engine, short_ids: list[int], long_ids: list[int], decoders: int, new_tokens: int,
                 budgets: list[int | None], rounds: int, as_json: bool, plot: str | None = None) -> None:
    from inferno.bench.mixed_load import mixed_load

    rows = mixed_load(engine, short_ids, long_ids, decoders, new_tokens, budgets, rounds)
    report = {"decoders": decoders, "prompt_tokens": len(long_ids), "new_tokens": new_tokens,
              "rounds": rounds, "runs": rows}
    if emit(report, plot, as_json, "plot_mixed"):
        return
    from inferno.cli.display import compact_table, titled

    table = compact_table()
    for name in ("step\ntokens", "ITL\nmedian ms", "ITL\np99 ms", "p99 /\nmedian", "ITL\nmax ms",
                 "long prompt\nTTFT ms", "decode\ntok/s"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        budget = "off" if r["step_tokens"] is None else str(r["step_tokens"])
        table.add_row(budget, f"{r['itl_median_ms']:.1f}", f"{r['itl_p99_ms']:.1f}",
                      f"{r['p99_over_median']:.2f}", f"{r['itl_max_ms']:.1f}",
                      f"{r['long_prompt_ttft_ms']:.0f}", f"{r['decode_tok_s']:.1f}")
    console().print(titled(f"{decoders} sequences decoding while a {len(long_ids)}-token prompt arrives "
                           f"(median of {rounds} rounds)", table))


def emit(report: dict, plot: str | None, as_json: bool, figure: str) -> bool:
    """Draw the report with `inferno.analysis.plots.<figure>` into --plot's file, print it with --json; True
    when that is all the command shows (--json)."""
    if plot is not None:
        from inferno.analysis import plots

        getattr(plots, figure)(report, plot)
    if as_json:
        json.dump(report, sys.stdout)
        print()
    return as_json


def main() -> None:
    run(command, PROG)


entry = script(main)  # the console script

if __name__ == "__main__":
    entry()
