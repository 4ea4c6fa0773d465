"""`kv-bench`: one prompt generated with no cache, `basic` and `prealloc`, side by side in one run."""

from __future__ import annotations

import json
import sys

import click

from inferno.bench.kv_modes import MODES, run_modes, summary_row
from inferno.cli.common import console, default_model, progress_on, run, set_threads
from inferno.errors import InfernoError

PROG = "kv-bench"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", required=False, type=click.Path(dir_okay=True))
@click.option("--prompt", default="Once upon a time", show_default=True)
@click.option("--new-tokens", "-n", type=int, default=128, show_default=True)
@click.option("--modes", default=",".join(MODES), show_default=True, help="Comma-separated subset to run.")
@click.option("--window", type=int, default=32, show_default=True,
              help="Decode steps averaged for the first/last forward columns.")
@click.option("--threads", type=int, default=None)
@click.option("--json", "as_json", is_flag=True)
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


def main() -> None:
    run(command, PROG)


if __name__ == "__main__":
    main()
