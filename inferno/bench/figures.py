"""What the benchmark measures (the plan), the figures each run yields, and their aggregation into
medians, inferno's ratios to the other engines and how far their greedy tokens agree."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from inferno.bench.processes import ChildResult

# llama.cpp as llama-cpp-python runs it (flash attention off) and as llama.cpp's own tools run it on a
# CPU (their default `auto` turns it on): faster at depth 0, slower deep in the context.
ENGINES = ("inferno", "llama.cpp", "llama.cpp-fa", "hf")
LABELS = {"inferno": "inferno", "llama.cpp": "llama.cpp", "llama.cpp-fa": "llama.cpp FA",
          "hf": "HF"}  # HF: transformers on torch
RUN_NEW = 32  # tokens of the whole-process run


@dataclass(frozen=True)
class Plan:
    """Prompt lengths and new tokens of each measurement (the defaults are the README's table)."""

    prefill_tokens: int = 512  # prefill tok/s: the first forward over a prompt this long
    deep_tokens: int = 2048  # decode tok/s @deep: decode steps after a prompt this long ...
    deep_new: int = 64  # ... generating this many tokens
    decode_new: int = 128  # decode tok/s @0: decode steps after the short prompt
    short_prompt: str = "Once upon a time"

    @property
    def prompt_lengths(self) -> dict[str, int]:
        """Prompt name -> exact tokens, for the prompts cut from English text (`short` is as it is)."""
        return {"prefill": self.prefill_tokens, "deep": self.deep_tokens}

    @property
    def measures(self) -> dict[str, tuple[str, int]]:
        """Measurement -> (prompt name, new tokens); each is one process per engine and round."""
        return {"prefill": ("prefill", 1), "decode0": ("short", self.decode_new),
                "decode_deep": ("deep", self.deep_new), "run32": ("short", RUN_NEW)}

    @property
    def figures(self) -> dict[str, tuple[str, bool]]:
        """Figure -> (column title, higher is better)."""
        return {
            "prefill_tok_s": (f"prefill\ntok/s @{self.prefill_tokens}", True),
            "decode_tok_s": ("decode\ntok/s @0", True),
            "decode_tok_s_deep": (f"decode\ntok/s @{self.deep_tokens}", True),
            "run32_wall_s": (f"{RUN_NEW}-token\nrun wall s", False),
            "run32_peak_rss_mib": (f"{RUN_NEW}-token run\npeak RSS MiB", False),
        }


@dataclass
class EngineRuns:
    """Everything one engine's measurements gave, round after round."""

    samples: dict[str, list[float]]  # figure -> one value per round
    runs: list[dict[str, Any]] = field(default_factory=list)  # one entry per measurement process
    version: str | None = None
    greedy_ids: list[int] = field(default_factory=list)  # of the decode @0 run
    sample: str = ""  # the start of that run's text


def figures_of(plan: Plan, engine: str, measure: str, res: ChildResult) -> dict[str, float]:
    """The figure(s) one measurement contributes, from its report in the engine's own format."""
    if measure == "run32":
        return {"run32_wall_s": res.wall_s, "run32_peak_rss_mib": res.peak_rss_mib}
    rep = res.report
    n_prompt = len(rep["prompt_ids"]) if engine == "inferno" else rep["n_prompt"]
    want = plan.prompt_lengths.get(plan.measures[measure][0])
    if want is not None and n_prompt != want:
        raise RuntimeError(f"{engine} saw {n_prompt} prompt tokens, not {want}")
    if measure == "prefill":
        value = rep["metrics"]["prefill_tok_s"] if engine == "inferno" else n_prompt / rep["prefill_s"]
        return {"prefill_tok_s": value}
    value = rep["metrics"]["decode_tok_s"] if engine == "inferno" else rep["n_decode"] / rep["decode_s"]
    return {"decode_tok_s" if measure == "decode0" else "decode_tok_s_deep": value}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy runs share before they first differ."""
    same = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        same += 1
    return same


def summarise(plan: Plan, runs: dict[str, EngineRuns]) -> dict[str, Any]:
    """Medians per engine, inferno's ratio to each other engine, and how far their greedy tokens agree."""
    engines: dict[str, Any] = {}
    for engine, got in runs.items():
        figures = {f: statistics.median(v) if v else None for f, v in got.samples.items()}
        engines[engine] = {"figures": figures, "version": got.version, "sample": got.sample or None,
                           "runs": got.runs}
    ratios: dict[str, dict[str, float | None]] = {}
    if "inferno" in engines:
        mine, my_ids = engines["inferno"]["figures"], runs["inferno"].greedy_ids
        for other in (e for e in engines if e != "inferno"):
            ratios[other] = {f: ratio(mine[f], engines[other]["figures"][f]) for f in plan.figures}
            # How far inferno's greedy tokens follow the other engine's: a cheap correctness hint.
            prefix = common_prefix(my_ids, runs[other].greedy_ids) if my_ids else None
            engines[other]["greedy_prefix_matching_inferno"] = prefix
    return {"plan": asdict(plan), "engines": engines, "ratios": ratios}
