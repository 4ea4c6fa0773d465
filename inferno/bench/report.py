"""The benchmark's result as a table for people (`--json` prints the same result as it is)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from inferno.bench.figures import LABELS, RUN_NEW, Plan
from inferno.cli.common import console


def render(result: dict[str, Any]) -> None:
    plan = Plan(**result["plan"])
    out = console()
    mach = result["machine"]
    out.print(f"[bold]inferno bench[/]  {result['model']}")
    threads = f"{result['threads']} thread{'s' if result['threads'] != 1 else ''}"
    out.print(f"{mach['cpu']}, {mach['cores']} cores; {threads}; "
              f"{result['rounds']} round(s){', medians' if result['rounds'] > 1 else ''}; {result['date']}")
    out.print(figures_table(plan, result))
    if mach["load_before"] > 0.5:
        out.print(f"[yellow]the machine was busy (1-minute load {mach['load_before']:.1f} on {mach['cores']} "
                  "cores before the run): figures are noisy. Thread pools that spin (llama.cpp's OpenMP) "
                  "collapse when their cores are shared: --threads 1 holds up better on a busy machine.[/]")
    out.print(f"[dim]@N: tokens already in context. prefill: first forward over {plan.prefill_tokens} "
              "tokens; "
              f"decode: {plan.decode_new} (@0) or {plan.deep_new} (@{plan.deep_tokens}) greedy tokens, "
              f"decode steps only; {RUN_NEW}-token run: a whole process, load to exit.[/]")
    if result["ratios"]:
        out.print("[dim]ratios are inferno / other: above 1 is better for tok/s, "
                  "below 1 for wall and RSS.[/]")
    versions = [f"{LABELS[e]}: {d['version']}" for e, d in result["engines"].items() if d.get("version")]
    if versions:
        out.print(f"[dim]versions: {'; '.join(versions)}[/]")
    for engine, why in result["skipped"].items():
        out.print(f"[yellow]skipped {LABELS[engine]}:[/] {why}")
    for note in result["errors"]:
        out.print(f"[red]error:[/] {note}")
    for engine, data in result["engines"].items():
        if data.get("sample"):
            out.print(f"[dim]{LABELS[engine]} greedy text: {data['sample']!r}[/]")


def figures_table(plan: Plan, result: dict[str, Any]) -> Table:
    """One row per engine, then one per ratio of inferno to another engine, green where inferno is better."""
    table = Table(show_lines=False)
    table.add_column("engine")
    for title, _ in plan.figures.values():
        table.add_column(title, justify="right")
    for engine, data in result["engines"].items():
        figures = data["figures"]
        digits = {f: 2 if f == "run32_wall_s" else 1 for f in plan.figures}
        table.add_row(LABELS[engine], *(cell(figures.get(f), digits[f]) for f in plan.figures))
    if result["ratios"]:
        table.add_section()
    for other, ratios in result["ratios"].items():
        row = []
        for f, (_, higher_better) in plan.figures.items():
            r = ratios.get(f)
            if r is None:
                row.append("—")
            else:
                good = r >= 1 if higher_better else r <= 1
                row.append(f"[{'green' if good else 'red'}]{r:.2f}x[/]")
        table.add_row(f"inferno / {LABELS[other]}", *row)
    return table


def cell(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"
