"""Running the benchmark: which engines can run, warm-up, then rounds of every measurement with the
engines alternating; each measurement is its own process (`processes`)."""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferno.bench import competitors
from inferno.bench.figures import LABELS, EngineRuns, Plan, figures_of, summarise
from inferno.bench.processes import ChildResult, aside, inferno_version, machine, probe, run_child
from inferno.bench.prompts import write_prompts

# engine -> the modules the other interpreter must have for it, and how to get them
REQUIREMENTS = {
    "llama.cpp": (("llama_cpp",), "pip install llama-cpp-python"),
    "llama.cpp-fa": (("llama_cpp",), "pip install llama-cpp-python"),
    "hf": (("torch", "transformers", "gguf"), "pip install torch transformers gguf"),
}


@dataclass(frozen=True)
class Options:
    model: Path
    threads: int = 2
    ctx: int = 4096  # llama.cpp's n_ctx and inferno's --max-context
    others_python: str = sys.executable  # the interpreter that has llama-cpp-python, torch + transformers
    timeout: float = 600  # seconds before one measurement process is killed
    rounds: int = 1  # of every measurement, engines alternating; figures are medians over them
    warm_up: bool = True  # an untimed whole run per engine first (page cache, JIT caches)


Log = Callable[[str], None]


def benchmark(options: Options, plan: Plan, wanted: list[str], log: Log = lambda _: None) -> dict[str, Any]:
    """The whole benchmark of the engines of `wanted` that can run, as the result `--json` prints."""
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    mach = machine()  # before any measurement runs, so its load average is other people's work
    engines, skipped = available(wanted, options.others_python)
    runs, errors = measure(options, plan, engines, log)
    o = options
    return {"date": started, "machine": {**mach, "load_after": round(os.getloadavg()[0], 2)},
            "model": o.model.name, "threads": o.threads, "rounds": o.rounds, "ctx": o.ctx,
            **summarise(plan, runs), "skipped": skipped, "errors": errors}


def available(wanted: list[str], others_python: str) -> tuple[list[str], dict[str, str]]:
    """The engines of `wanted` that can run, and why each other one cannot."""
    found = probe(others_python, sorted({m for modules, _ in REQUIREMENTS.values() for m in modules}))
    engines, skipped = [], {}
    for engine in wanted:
        modules, how = REQUIREMENTS.get(engine, ((), ""))
        if all(found[m] for m in modules):
            engines.append(engine)
        else:
            skipped[engine] = f"{', '.join(modules)} not importable ({how})"
    return engines, skipped


class Bench:
    """The command line and environment of every measurement of one benchmark."""

    def __init__(self, options: Options, plan: Plan, prompt_files: dict[str, Path]) -> None:
        self.options = options
        self.plan = plan
        self.prompt_files = prompt_files
        self.env = dict(os.environ)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            self.env[var] = str(options.threads)
        # Competitors must load from the local file, never reach for a hub.
        self.env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                        HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")

    def command(self, engine: str, measure: str) -> list[str]:
        prompt, n_new = self.plan.measures[measure]
        o = self.options
        if engine == "inferno":
            return [sys.executable, "-m", "inferno.cli.generate", "--kv", "prealloc",
                    "--threads", str(o.threads), "--json", "--ignore-eos", "--max-context", str(o.ctx),
                    "--", str(o.model), self.prompt_files[prompt].read_text(), str(n_new)]
        n_prompt = self.plan.prompt_lengths.get(prompt, 0)
        return [o.others_python, competitors.__file__, engine, str(o.model), str(self.prompt_files[prompt]),
                str(n_prompt), str(n_new), str(o.threads), str(o.ctx)]

    def run(self, engine: str, measure: str) -> ChildResult:
        return run_child(self.command(engine, measure), self.env, self.options.timeout)


def measure(
    options: Options, plan: Plan, engines: list[str], log: Log = lambda _: None
) -> tuple[dict[str, EngineRuns], list[str]]:
    """Every measurement of every engine, `options.rounds` times: (what each engine gave, errors).

    An untimed whole run per engine first warms the page cache and the JIT caches; an engine whose
    warm-up fails is not measured. Rounds rotate which engine goes first.
    """
    runs = {e: EngineRuns(samples={f: [] for f in plan.figures}) for e in engines}
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="inferno-bench-") as tmp:
        bench = Bench(options, plan, aside(write_prompts, options.model, plan, Path(tmp)))
        working = list(engines)
        if options.warm_up:
            for engine in engines:
                log(f"warm-up  {LABELS[engine]} ...")
                res = bench.run(engine, "run32")
                if not res.ok:
                    errors.append(f"{LABELS[engine]} warm-up: {res.error}")
                    working.remove(engine)
        for rnd in range(options.rounds):
            first = rnd % max(len(working), 1)
            for name in plan.measures:
                for engine in working[first:] + working[:first]:
                    try:
                        res = bench.run(engine, name)
                        if not res.ok:
                            raise RuntimeError(res.error)
                        figures = figures_of(plan, engine, name, res)
                    except (RuntimeError, KeyError, TypeError, ZeroDivisionError) as bad:
                        errors.append(f"{LABELS[engine]} {name} (round {rnd + 1}): {bad}")
                        continue
                    record(runs[engine], engine, name, rnd, figures, res)
                    shown = ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
                    log(f"round {rnd + 1}/{options.rounds}  {name:<11} {LABELS[engine]:<16} {shown}")
    return runs, errors


def record(got: EngineRuns, engine: str, measure: str, rnd: int, figures: dict[str, float],
           res: ChildResult) -> None:
    """Add one measurement's figures and the facts behind them to what its engine gave."""
    for f, v in figures.items():
        got.samples[f].append(v)
    rep = res.report
    got.version = inferno_version() if engine == "inferno" else rep.get("version")
    if measure == "decode0":
        got.greedy_ids = rep.get("token_ids") or []
        got.sample = rep.get("text", "")[:80]
    entry = {"round": rnd + 1, "measure": measure, "figures": figures, "child_wall_s": round(res.wall_s, 3),
             "child_peak_rss_mib": round(res.peak_rss_mib, 1)}
    if engine == "inferno":
        # Where inferno's own time went (JIT, load, cache), to explain the figures.
        metrics = rep.get("metrics", {})
        entry["inferno_metrics"] = {k: v for k, v in metrics.items() if not isinstance(v, list)}
    got.runs.append(entry)

