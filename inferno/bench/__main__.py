"""`python -m inferno.bench`: inferno against llama.cpp (llama-cpp-python) and HF transformers on one GGUF.

Figures, per engine, on the same prompts and thread count:
  prefill tok/s        first forward over a 512-token prompt
  decode tok/s @0      128 greedy tokens after a short prompt, decode steps only
  decode tok/s @2048   64 greedy tokens after a 2048-token prompt, decode steps only
  32-token run         wall seconds and peak RSS of a whole process that loads the model and
                       generates 32 tokens from "Once upon a time"

Every measurement of every engine is its own process. Rounds alternate the engines and report
medians. Competitors are measured only when importable (llama_cpp; torch + transformers). llama.cpp
runs twice: as llama-cpp-python leaves it (flash attention off) and as llama.cpp's own tools run it
on a CPU (`llama.cpp-fa`: on).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from inferno.bench.figures import ENGINES, Plan
from inferno.bench.measure import Options, benchmark
from inferno.cli.common import default_model, run
from inferno.errors import InfernoError

PROG = "python -m inferno.bench"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="GGUF file (default: the default model).")
@click.option("--threads", type=int, default=2, show_default=True, help="Threads for every engine.")
@click.option("--rounds", type=int, default=1, show_default=True,
              help="Rounds, engines alternating; medians reported.")
@click.option("--ctx", type=int, default=4096, show_default=True,
              help="Context capacity: llama.cpp n_ctx and inferno --max-context.")
@click.option("--engines", default=",".join(ENGINES), show_default=True, help="Comma-separated subset.")
@click.option("--others-python", default=sys.executable, metavar="PYTHON",
              help="Interpreter with llama-cpp-python / torch + transformers (default: this one).")
@click.option("--timeout", type=float, default=600, show_default=True,
              help="Seconds before one measurement is killed.")
@click.option("--no-warmup", is_flag=True, help="Skip the untimed warm-up run per engine.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def command(model, threads, rounds, ctx, engines, others_python, timeout, no_warmup, as_json):
    """Measure inferno, and llama.cpp and HF transformers when importable, on the same GGUF model,
    prompts and threads."""
    plan = Plan()
    model = (model or default_model()).resolve()
    if not model.is_file():
        raise InfernoError(f"no model file at {model} (`make model` fetches the default one)")
    if threads < 1 or rounds < 1:
        raise InfernoError("--threads and --rounds must be at least 1")
    if ctx < plan.deep_tokens + plan.deep_new:
        raise InfernoError(f"--ctx must be at least {plan.deep_tokens + plan.deep_new} "
                           f"for the depth-{plan.deep_tokens} decode")
    wanted = [e.strip() for e in engines.split(",") if e.strip()]
    if bad := [e for e in wanted if e not in ENGINES]:
        raise InfernoError(f"unknown engine(s) {', '.join(bad)}; choose from {', '.join(ENGINES)}")

    options = Options(model, threads, ctx, others_python, timeout, rounds, warm_up=not no_warmup)
    result = benchmark(options, plan, wanted, log)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        from inferno.bench.report import render

        render(result)
    measured = [v for data in result["engines"].values() for v in data["figures"].values() if v is not None]
    if not measured:
        sys.exit(1)


def log(message: str) -> None:
    click.echo(message, err=True)


def main() -> None:
    run(command, PROG)


if __name__ == "__main__":
    main()
