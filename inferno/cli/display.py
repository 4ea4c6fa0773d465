"""Rich renderings shared by the commands: metric panels and terminal plots of per-forward time."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from inferno.runtime.metrics import RunRecord

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


def short_bytes(n: int) -> str:
    """Bytes in at most 8 characters, for a table column: 495 KiB, 1.23 MiB, 12.3 GiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return f"{n} B"


def titled(title: str, table: Table) -> Group:
    """A table under its title as a line of its own: a title wider than the table is not wrapped to it."""
    return Group(Text(title, style="bold"), table)


def compact_table() -> Table:
    """A table with a rule under its header and no other lines: 80 columns hold eight figures."""
    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1),
                 header_style="bold")


def column(table: Table, header: str, justify: str = "right") -> None:
    """A column whose cells never wrap: a header that is too long goes over two lines (`decode\ntok/s`)."""
    table.add_column(header, justify=justify, no_wrap=True)


def kernels_line(kernels_ms: dict[str, float]) -> Text:
    """What loading or compiling kernels cost on each row's first use, which its other figures leave out."""
    spent = {name: ms for name, ms in kernels_ms.items() if ms >= 0.5}
    if not spent:
        return Text("kernels: every one was loaded before the timed runs", style="dim")
    return Text("kernels loaded or compiled on first use (left out of the figures): "
                + ", ".join(f"{name} {ms:,.0f} ms" for name, ms in spent.items()), style="dim")


def metrics_panel(run: RunRecord, width: int = 80) -> Table:
    """The Metrics block model-generate prints after the text, fitting `width` columns."""
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
            ("decode forwards", sparkline(forwards[1:], max(8, min(64, width - 28))) or "none"),
            ("every forward (ms)", " ".join(f"{f:.1f}" for f in forwards)),
        ]
    s = run.startup
    startup = f"imports {s.imports_ms:.0f} ms, " if s.imports_ms is not None else ""
    cached = {"hit": " (cached)", "miss": " (now cached)"}.get(s.model_cache, "")
    startup += f"load {s.load_ms:.0f} ms{cached}, kernels {s.jit_ms:.0f} ms"
    rows.append(("startup", startup))
    wall = f"{run.wall_ms:.0f} ms"
    if run.load_cache_ms is not None:
        wall += f", snapshot loaded in {run.load_cache_ms:.0f} ms"
    rows.append(("run", wall))
    for name, value in rows:
        table.add_row(name, value)
    return table


SERIES_STYLES = {"off": ("o", "red"), "basic": ("b", "yellow"), "prealloc": ("p", "green")}


def bench_table(rows: dict[str, dict], prompt_tokens: int, new_tokens: int, average: int) -> Group:
    """kv-bench's modes side by side (each row as its --json summary holds it), and under them what
    loading kernels cost each on its first use."""
    table = compact_table()
    column(table, "mode", "left")
    for name in ("TTFT\nms", "decode\ntok/s", f"first {average}\nfwd ms", f"last {average}\nfwd ms",
                 "last /\nfirst", "cache"):
        column(table, name)
    for mode, r in rows.items():
        table.add_row(
            mode,
            f"{r['ttft_ms']:.1f}",
            f"{r['decode_tok_s']:.1f}",
            f"{r['first_forward_ms']:.2f}",
            f"{r['last_forward_ms']:.2f}",
            f"{r['last_over_first']:.2f}x",
            short_bytes(r["cache_bytes"]),
        )
    title = f"KV cache modes, {prompt_tokens}-token prompt, {new_tokens} new tokens"
    parts = [Text(title, style="bold"), table]
    if any("kernels_ms" in r for r in rows.values()):
        parts.append(kernels_line({mode: r.get("kernels_ms", 0.0) for mode, r in rows.items()}))
    return Group(*parts)


def sweep_table(rows: list[dict], prompt_tokens: int, new_tokens: int, block_size: int,
                activations: str = "f32") -> Group:
    title = (f"batch sweep: {prompt_tokens}-token prompt, B x {new_tokens} greedy tokens, "
             f"blocks of {block_size}")
    if activations != "f32":
        title += f", {activations} activations"
    table = compact_table()
    for name in ("B", "decode\ntok/s", "per seq\ntok/s", "step\nms", "reused\ntokens", "peak\ncache",
                 "unshared\npeak"):
        column(table, name)
    for r in rows:
        table.add_row(
            str(r["batch"]),
            f"{r['decode_tok_s']:.1f}",
            f"{r['per_sequence_tok_s']:.1f}",
            f"{r['step_ms']:.1f}",
            str(r["reused_tokens"]),
            short_bytes(r["peak_cache_bytes"]),
            short_bytes(r["unshared_peak_bytes"]),
        )
    return titled(title, table)


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
    lines += [" " * 11 + "└" + "─" * width, f"{margin}decode steps 1 to {steps}", margin + legend]
    return "\n".join(lines)


def fidelity_table(rows: Sequence[dict], source: str, tokens: int) -> Group:
    """kv-bench --fidelity: each element type against the float32 cache on one teacher-forced text (rows
    as its --json holds them); a row whose activations are not the reference's says so (`q8_0 int8`)."""
    table = compact_table()
    column(table, "type", "left")
    for name in ("bits /\nvalue", "cache", "top-1\nagree", "KL mean", "KL max", "perplexity", "decode\nms"):
        column(table, name)
    for r in rows:
        name = r["dtype"] if r["activations"] == "f32" else f"{r['dtype']} {r['activations']}"
        table.add_row(name, f"{r['bits_per_value']:.3g}", short_bytes(r["cache_bytes"]),
                      f"{r['top1_agreement']:.2%}", f"{r['kl_mean']:.2e}", f"{r['kl_max']:.3f}",
                      f"{r['perplexity']:.3f}", f"{r['decode_ms']:.2f}")
    title = f"KV element types against the f32 cache, {tokens} tokens of {source}"
    parts = [Text(title, style="bold"), table]
    if any("kernels_ms" in r for r in rows):
        parts.append(kernels_line({r["dtype"]: r.get("kernels_ms", 0.0) for r in rows}))
    return Group(*parts)


@contextmanager
def counting(err, total: int, what: str) -> Iterator[Callable[[int], None]]:
    """A progress bar of `what` (e.g. "requests finished") out of `total` on the stderr console `err`,
    gone when done; None (--quiet, --json) or not a terminal: no bar (rich ends a bar in a file or pipe
    with an empty line, which would stand before a refusal's one line). Yields advance(n)."""
    if err is None or err.quiet or not err.is_terminal:
        yield lambda _n: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(what), BarColumn(bar_width=24), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n=1: bar.advance(task, n)


class Counted:
    """`model` whose method `name` calls advance(1) after each call: progress for code that takes a model."""

    def __init__(self, model, name: str, advance):
        self._model, self._name, self._advance = model, name, advance

    def __getattr__(self, attr):
        value = getattr(self._model, attr)
        if attr != self._name:
            return value

        def counted(*args, **kwargs):
            result = value(*args, **kwargs)
            self._advance(1)
            return result

        return counted
