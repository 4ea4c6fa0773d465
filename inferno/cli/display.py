"""Rich renderings shared by the commands: metric panels and terminal plots of per-forward time."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from inferno.metrics import RunRecord

BARS = "▁▂▃▄▅▆▇█"


def bucket_means(values: Sequence[float], width: int) -> list[float]:
    """values averaged into at most `width` consecutive buckets, so a long series fits a line."""
    buckets = min(width, len(values))
    means = []
    for b in range(buckets):
        chunk = values[b * len(values) // buckets : (b + 1) * len(values) // buckets]
        means.append(sum(chunk) / len(chunk))
    return means


def sparkline(values: Sequence[float], width: int = 64) -> str:
    """One bar character per bucket of values, scaled from 0 to the max."""
    means = bucket_means(values, width)
    top = max(means, default=0.0) or 1.0
    return "".join(BARS[round(m / top * (len(BARS) - 1))] for m in means)


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def metrics_panel(run: RunRecord) -> Table:
    """The Metrics block model-generate prints after the text."""
    table = Table(title="Metrics", show_header=False, title_justify="left", box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    m = run.metrics
    forwards = m.per_forward_ms
    decode_tok_s = f"{m.decode_tok_s:.1f}" if m.decode_tok_s else "n/a (one token)"
    tpot = f"{m.tpot_ms:.2f} ms" if m.tpot_ms else "n/a"
    cache = (
        f"{m.cache} {m.cache_dtype}: {fmt_bytes(m.cache_bytes)} for {m.cache_capacity} tokens"
        if m.cache
        else "off (every step reruns the whole sequence)"
    )
    if m.evicted_tokens:
        cache += f", {m.evicted_tokens:,} evicted"
    prefill = f"prefill {m.prefill_tok_s:.0f} tok/s" if m.prefill_tok_s else "no forward finished"
    rows = [
        ("KV cache", cache),
        ("tokens", f"{m.prompt_tokens} prompt ({m.prefilled_tokens} prefilled), {m.generated_tokens} new"),
        ("time to first token", f"{m.ttft_ms:.1f} ms  ({prefill})"),
        ("decode", f"{decode_tok_s} tok/s, {tpot} per output token"),
    ]
    if m.activations != "f32":
        rows.append(("activations", f"{m.activations} (not the float reference's arithmetic)"))
    if forwards:
        rows += [
            ("per forward", f"min {min(forwards):.2f}  max {max(forwards):.2f}  "
                            f"mean {sum(forwards) / len(forwards):.2f} ms over {len(forwards)}"),
            ("decode forwards", sparkline(forwards[1:]) or "none"),
            ("every forward (ms)", " ".join(f"{f:.1f}" for f in forwards)),
        ]
    s = run.startup
    startup = f"imports {s.imports_ms:.0f} ms, " if s.imports_ms is not None else ""
    cached = {"hit": " (cached)", "miss": " (now cached)"}.get(s.model_cache, "")
    startup += f"load {s.load_ms:.0f} ms{cached}, kernels {s.jit_ms:.0f} ms, "
    startup += f"run {run.wall_ms:.0f} ms"
    if run.load_cache_ms is not None:
        startup += f", snapshot {run.load_cache_ms:.0f} ms"
    rows.append(("startup", startup))
    for name, value in rows:
        table.add_row(name, value)
    return table


SERIES_STYLES = {"off": ("o", "red"), "basic": ("b", "yellow"), "prealloc": ("p", "green")}


def bench_table(rows: dict[str, dict], prompt_tokens: int, new_tokens: int, window: int) -> Table:
    title = f"KV cache modes, {prompt_tokens}-token prompt, {new_tokens} new tokens"
    table = Table(title=title, title_justify="left")
    table.add_column("mode")
    for name in ("TTFT ms", "decode tok/s", f"first {window} fwd ms", f"last {window} fwd ms", "last/first",
                 "cache"):
        table.add_column(name, justify="right")
    for mode, r in rows.items():
        table.add_row(
            mode,
            f"{r['ttft_ms']:.1f}",
            f"{r['decode_tok_s']:.1f}",
            f"{r['first_forward_ms']:.2f}",
            f"{r['last_forward_ms']:.2f}",
            f"{r['last_over_first']:.2f}x",
            fmt_bytes(r["cache_bytes"]),
        )
    return table


def sweep_table(rows: list[dict], prompt_tokens: int, new_tokens: int, block_size: int,
                activations: str = "f32") -> Table:
    title = (f"batch sweep: {prompt_tokens}-token prompt, B x {new_tokens} greedy tokens, "
             f"blocks of {block_size}")
    if activations != "f32":
        title += f", {activations} activations"
    table = Table(title=title, title_justify="left")
    for name in ("B", "decode tok/s", "per seq tok/s", "step ms", "reused", "peak cache", "unshared"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(
            str(r["batch"]),
            f"{r['decode_tok_s']:.1f}",
            f"{r['per_sequence_tok_s']:.1f}",
            f"{r['step_ms']:.1f}",
            str(r["reused_tokens"]),
            fmt_bytes(r["peak_cache_bytes"]),
            fmt_bytes(r["unshared_peak_bytes"]),
        )
    return table


def forward_chart(series: dict[str, Sequence[float]], height: int = 12, width: int = 72) -> str:
    """Per-forward ms of each series on one shared scale (rich markup), decode step along the x axis."""
    top = max(max(v) for v in series.values() if v) or 1.0
    grid = [[" "] * width for _ in range(height)]
    for name, values in series.items():
        mark, color = SERIES_STYLES.get(name, (name[0], "white"))
        for col, mean in enumerate(bucket_means(values, width)):
            level = round(mean / top * (height - 1))
            grid[height - 1 - level][col] = f"[{color}]{mark}[/]"
    axis = [f"{top * (height - 1 - i) / (height - 1):8.1f} ms │" for i in range(height)]
    lines = [label + "".join(row) for label, row in zip(axis, grid, strict=True)]
    steps = max(len(v) for v in series.values())
    legend = "   ".join(
        f"[{SERIES_STYLES[k][1]}]{SERIES_STYLES[k][0]}[/] {k}" for k in series if k in SERIES_STYLES
    )
    margin = " " * 12
    lines += [" " * 11 + "└" + "─" * width, f"{margin}decode step 1 … {steps}", margin + legend]
    return "\n".join(lines)


def fidelity_table(rows: Sequence, source: str, tokens: int) -> Table:
    """kv-bench --fidelity: each element type against the float32 cache on one teacher-forced text."""
    table = Table(title=f"KV element types against the f32 cache, {tokens} tokens of {source}",
                  title_justify="left")
    columns = (("dtype", "left"), ("activations", "left"), ("bits/value", "right"), ("cache", "right"),
               ("top-1 agree", "right"), ("KL mean", "right"), ("KL max", "right"), ("perplexity", "right"),
               ("decode ms", "right"))
    for name, justify in columns:
        table.add_column(name, justify=justify)
    for r in rows:
        table.add_row(r.dtype, r.activations, f"{r.bits_per_value:.3g}", fmt_bytes(r.cache_bytes),
                      f"{r.top1_agreement:.2%}", f"{r.kl_mean:.2e}", f"{r.kl_max:.3f}", f"{r.perplexity:.3f}",
                      f"{r.decode_ms:.2f}")
    return table
