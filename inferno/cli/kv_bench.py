"""`kv-bench`: one prompt generated with no cache and each cache kind, side by side in one run; with
`--batch-sweep 1,2,4,8`, the prompt forked into B sequences decoded together, for each B."""

from __future__ import annotations

import json
import sys

import click

from inferno.bench.batch_sweep import batch_sweep, parse_sizes
from inferno.bench.kv_modes import MODES, run_modes, summary_row
from inferno.cli.common import console, default_model, progress_on, run, set_threads
from inferno.errors import InfernoError
from inferno.kv.paged import BLOCK_SIZE

PROG = "kv-bench"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", required=False, type=click.Path(dir_okay=True))
@click.option("--prompt", default="Once upon a time", show_default=True)
@click.option("--new-tokens", "-n", type=int, default=128, show_default=True)
@click.option("--modes", default=",".join(MODES), show_default=True, help="Comma-separated subset to run.")
@click.option("--window", type=int, default=32, show_default=True,
              help="Decode steps averaged for the first/last forward columns.")
@click.option("--batch-sweep", "sweep", default=None, metavar="B1,B2,...",
              help="Instead of the modes: for each B, the prompt prefilled once and B greedy sequences "
                   "decoded together in a paged pool (e.g. 1,2,4,8,16).")
@click.option("--block-size", type=int, default=BLOCK_SIZE, show_default=True,
              help="Tokens per block of the --batch-sweep pool.")
@click.option("--threads", type=int, default=None)
@click.option("--json", "as_json", is_flag=True)
def command(model, prompt, new_tokens, modes, window, sweep, block_size, threads, as_json):
    """Show what a KV cache buys: per-forward time climbs without one and stays flat with one.
    With --batch-sweep: what decoding many sequences together buys."""
    set_threads(threads)
    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    unknown = [m for m in chosen if m not in MODES]
    if unknown or not chosen:
        raise InfernoError(f"unknown mode {','.join(unknown) or '(none)'} (valid: {', '.join(MODES)})")
    if new_tokens < 2:
        raise InfernoError(f"--new-tokens must be at least 2, got {new_tokens}")
    if sweep is not None:
        return sweep_command(model, prompt, new_tokens, parse_sizes(sweep), block_size, as_json)
    from inferno.engine import Engine

    err = console(stderr=True)
    engine = Engine.load(model or default_model(), progress=None if as_json else progress_on(err))
    prompt_ids = engine.tokenizer.encode(prompt)
    results = run_modes(engine, prompt_ids, new_tokens, chosen)
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


def sweep_command(
    model: str | None, prompt: str, new_tokens: int, sizes: list[int], block_size: int, as_json: bool
) -> None:
    if block_size < 1:
        raise InfernoError(f"--block-size must be at least 1, got {block_size}")
    from inferno.engine import Engine

    status = None if as_json else console(stderr=True)
    engine = Engine.load(model or default_model(), progress=progress_on(status))
    prompt_ids = engine.tokenizer.encode(prompt)
    rows = batch_sweep(engine, prompt_ids, new_tokens, sizes, block_size)
    if as_json:
        json.dump({"prompt_tokens": len(prompt_ids), "new_tokens": new_tokens, "block_size": block_size,
                   "sweep": rows}, sys.stdout)
        print()
        return
    from inferno.cli.display import sweep_table

    out = console()
    out.print(sweep_table(rows, len(prompt_ids), new_tokens, block_size))
    same = all(r["identical_tokens"] for r in rows)
    out.print("every sequence of every batch generated the same tokens" if same
              else "[bold red]sequences of one batch generated different tokens[/]")


def main() -> None:
    run(command, PROG)


if __name__ == "__main__":
    main()
