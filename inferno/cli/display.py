"""Rich renderings shared by the commands: metric panels and terminal plots of per-forward time."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 64) -> str:
    """One character per value (averaged into `width` buckets), scaled from 0 to the max."""
    if not values:
        return ""
    buckets = min(width, len(values))
    means = []
    for b in range(buckets):
        chunk = values[b * len(values) // buckets : (b + 1) * len(values) // buckets]
        means.append(sum(chunk) / len(chunk))
    top = max(means) or 1.0
    return "".join(BARS[min(len(BARS) - 1, int(m / top * (len(BARS) - 1) + 0.5))] for m in means)


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def metrics_panel(m: dict) -> Table:
    """The Metrics block model-generate prints after the text."""
    table = Table(title="Metrics", show_header=False, title_justify="left", box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    forwards = m["per_forward_ms"]
    decode_tok_s = f"{m['decode_tok_s']:.1f}" if m["decode_tok_s"] else "n/a (one token)"
    tpot = f"{m['tpot_ms']:.2f} ms" if m["tpot_ms"] else "n/a"
    cache = (
        f"{m['cache']}: {fmt_bytes(m['cache_bytes'])} for {m['cache_capacity']} tokens"
        if m["cache"]
        else "off (every step reruns the whole sequence)"
    )
    rows = [
        ("KV cache", cache),
        ("tokens", f"{m['prompt_tokens']} prompt ({m['prefilled_tokens']} prefilled), "
                   f"{m['generated_tokens']} new"),
        ("time to first token", f"{m['ttft_ms']:.1f} ms  (prefill {m['prefill_tok_s']:.0f} tok/s)"),
        ("decode", f"{decode_tok_s} tok/s, {tpot} per output token"),
        ("per forward", f"min {m['forward_ms_min']:.2f}  max {m['forward_ms_max']:.2f}  "
                        f"mean {m['forward_ms_mean']:.2f} ms over {len(forwards)}"),
        ("decode forwards", sparkline(forwards[1:]) or "none"),
        ("every forward (ms)", " ".join(f"{f:.1f}" for f in forwards)),
        ("startup", f"load {m['load_ms']:.0f} ms, kernels {m['jit_ms']:.0f} ms, run {m['wall_ms']:.0f} ms"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
