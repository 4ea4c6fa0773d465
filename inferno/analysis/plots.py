"""Figures of kv-bench and kv-inspect results, drawn with matplotlib into SVG or PNG files (`--plot FILE`).

Each function takes the dict the command's `--json` prints and a file name. matplotlib is imported here
only, when a figure is asked for, with the Agg backend (no display needed), so start-up stays fast.

    plot_forwards   kv-bench               per-forward ms of each mode: the no-cache climb, flat cached decode
    plot_sweep      kv-bench --batch-sweep aggregate tok/s and cache bytes against B
    plot_fidelity   kv-bench --fidelity    top-1 agreement and KL against bits per value
    plot_mixed      kv-bench --mixed-load  inter-token latency per step-token budget
    plot_inspect    kv-inspect             K/V norms, the attention of the last query, the paged block map
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

from inferno.errors import InfernoError

FORMATS = ("png", "svg")
# the modes' colours, as the terminal chart draws them
MODE_COLOURS = {"off": "tab:red", "basic": "goldenrod", "prealloc": "tab:green", "window": "tab:purple",
                "paged": "tab:blue"}


def plot_format(path: str | os.PathLike) -> str:
    """png or svg, by the file name's extension; anything else refused in one line."""
    ext = os.path.splitext(str(path))[1].lower().lstrip(".")
    if ext not in FORMATS:
        raise InfernoError(f"--plot {path}: the file name must end in .svg or .png (the image's format)")
    return ext


check_plot_file = plot_format  # before any work: a bad name is refused before the model loads


@contextmanager
def figure(path: str | os.PathLike, *subplots: int, size: tuple[float, float] = (8.0, 4.5)):
    """A matplotlib figure with a grid of subplots (rows, columns), saved to `path` on leaving."""
    fmt = plot_format(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*(subplots or (1, 1)), figsize=size, squeeze=False)
    try:
        yield fig, axes.ravel()
        fig.tight_layout()
        # no date, version or random ids in the file: the same results make the same bytes
        metadata = {"Date": None, "Creator": None} if fmt == "svg" else {"Software": None}
        with plt.rc_context({"svg.hashsalt": "inferno"}):
            fig.savefig(path, format=fmt, dpi=120, metadata=metadata)
    except OSError as exc:
        raise InfernoError(f"cannot write --plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def _colour(label: str) -> str | None:
    return MODE_COLOURS.get(label.split("/")[0])


def plot_forwards(report: dict[str, Any], path: str | os.PathLike) -> None:
    """kv-bench's modes: each decode step's forward ms (the first, the prefill, is TTFT in the legend)."""
    with figure(path) as (_fig, (ax,)):
        for label, run in report["runs"].items():
            forwards = run["metrics"]["per_forward_ms"]
            decodes = forwards[1:]
            ttft = run["metrics"].get("ttft_ms", forwards[0] if forwards else 0.0)
            ax.plot(range(1, len(decodes) + 1), decodes, label=f"{label} (TTFT {ttft:.0f} ms)",
                    color=_colour(label), linewidth=1.5)
        ax.set_xlabel("decode step")
        ax.set_ylabel("forward ms")
        ax.set_ylim(bottom=0)
        ax.set_title(f"Per-forward time, {report['prompt_tokens']}-token prompt, "
                     f"{report['new_tokens']} new tokens: no cache climbs, a cache stays flat")
        ax.grid(alpha=0.3)
        ax.legend()


def plot_sweep(report: dict[str, Any], path: str | os.PathLike) -> None:
    """kv-bench --batch-sweep: aggregate decode tok/s, and peak cache bytes (shared and not), against B."""
    rows = report["sweep"]
    batch = [r["batch"] for r in rows]
    with figure(path, 1, 2, size=(10.0, 4.2)) as (fig, (speed, memory)):
        speed.plot(batch, [r["decode_tok_s"] for r in rows], "o-", label="all sequences")
        speed.plot(batch, [r["per_sequence_tok_s"] for r in rows], "s--", label="per sequence")
        speed.set_xlabel("sequences decoded together (B)")
        speed.set_ylabel("decode tok/s")
        speed.set_ylim(bottom=0)
        speed.legend()
        mib = 1 << 20
        memory.plot(batch, [r["peak_cache_bytes"] / mib for r in rows], "o-",
                    label="peak, prompt blocks shared")
        memory.plot(batch, [r["unshared_peak_bytes"] / mib for r in rows], "s--", label="unshared")
        memory.set_xlabel("sequences decoded together (B)")
        memory.set_ylabel("KV cache MiB")
        memory.set_ylim(bottom=0)
        memory.legend()
        for ax in (speed, memory):
            ax.set_xticks(batch)
            ax.grid(alpha=0.3)
        fig.suptitle(f"Batch sweep: {report['prompt_tokens']}-token prompt, "
                     f"B x {report['new_tokens']} tokens, blocks of {report['block_size']}")


def plot_fidelity(report: dict[str, Any], path: str | os.PathLike) -> None:
    """kv-bench --fidelity: top-1 agreement and mean KL of each element type against its bits per value."""
    rows = report["rows"]
    bits = [r["bits_per_value"] for r in rows]
    names = [r["dtype"] if r.get("activations", "f32") == "f32" else f"{r['dtype']} ({r['activations']})"
             for r in rows]
    with figure(path, 1, 2, size=(10.0, 4.2)) as (fig, (agree, kl)):
        agreement = [100 * r["top1_agreement"] for r in rows]
        agree.scatter(bits, agreement)
        agree.set_ylabel("top-1 agreement with f32, %")
        # the f32 reference has KL 0, which a log scale cannot show: it is drawn at the floor
        kls = [r["kl_mean"] for r in rows]
        floor = min((k for k in kls if k > 0), default=1e-6) / 10
        shown = [max(k, floor) for k in kls]
        kl.scatter(bits, shown)
        kl.set_yscale("log")
        kl.set_ylabel("mean KL(f32 || type), nats")
        for ax, ys in ((agree, agreement), (kl, shown)):
            for x, y, name in zip(bits, ys, names, strict=True):
                ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            ax.set_xlabel("bits per value")
            ax.grid(alpha=0.3)
        fig.suptitle(f"KV element types against the f32 cache, {report['tokens']} tokens")


def plot_mixed(report: dict[str, Any], path: str | os.PathLike) -> None:
    """kv-bench --mixed-load: the decoders' inter-token latency under each step-token budget; over time
    when the rows hold the gaps (`itl_ms`), else its median, p99 and max side by side."""
    rows = report["runs"]
    names = ["no budget" if r["step_tokens"] is None else f"{r['step_tokens']} tokens/step" for r in rows]
    with figure(path) as (_fig, (ax,)):
        if all("itl_ms" in r for r in rows):
            for name, r in zip(names, rows, strict=True):
                ax.plot(range(1, len(r["itl_ms"]) + 1), r["itl_ms"], label=name, linewidth=1)
            ax.set_xlabel("decode token, in order of arrival")
        else:
            width = 0.8 / 3
            for i, (stat, label) in enumerate((("itl_median_ms", "median"), ("itl_p99_ms", "p99"),
                                               ("itl_max_ms", "max"))):
                ax.bar([j + (i - 1) * width for j in range(len(rows))], [r[stat] for r in rows], width,
                       label=label)
            ax.set_xticks(range(len(rows)), names)
        ax.set_ylabel("inter-token latency, ms")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{report['decoders']} sequences decoding while a {report['prompt_tokens']}-token "
                     "prompt arrives")
        ax.grid(alpha=0.3)
        ax.legend()


def plot_inspect(report: dict[str, Any], path: str | os.PathLike) -> None:
    """kv-inspect: mean |K| and |V| per layer and KV head; with --layer, the attention of the last query
    per head and position; with --kv paged, the block map (each sequence's blocks, shared ones marked)."""
    panels = ["norms"] + (["attention"] if "attention" in report else []) + (["blocks"] if "blocks" in report
                                                                           else [])
    with figure(path, len(panels), 1, size=(9.0, 3.6 * len(panels))) as (fig, axes):
        for ax, panel in zip(axes, panels, strict=True):
            {"norms": _norms, "attention": _attention, "blocks": _block_map}[panel](fig, ax, report)


def _heatmap(fig, ax, values, xlabels: Sequence[str], ylabels: Sequence[str], label: str) -> None:
    image = ax.imshow(values, aspect="auto", cmap="plasma", interpolation="nearest")
    fig.colorbar(image, ax=ax, label=label)
    step_x = max(1, len(xlabels) // 32)
    step_y = max(1, len(ylabels) // 32)
    ax.set_xticks(range(0, len(xlabels), step_x), list(xlabels)[::step_x], rotation=90, fontsize=7)
    ax.set_yticks(range(0, len(ylabels), step_y), list(ylabels)[::step_y], fontsize=7)


def _norms(fig, ax, r: dict[str, Any]) -> None:
    import numpy as np

    keys, values = np.array(r["key_norms"]), np.array(r["value_norms"])
    heads = r["kv_heads"]
    both = np.concatenate([keys, values], axis=1).T  # rows: K kv0.., V kv0..; columns: layers
    labels = [f"K kv{h}" for h in range(heads)] + [f"V kv{h}" for h in range(heads)]
    _heatmap(fig, ax, both, [f"L{i}" for i in range(r["layers"])], labels, "mean L2 norm")
    ax.set_title("mean |K| and |V| per layer and KV head")


def _attention(fig, ax, r: dict[str, Any]) -> None:
    import numpy as np

    weights = np.array(r["attention"]["weights"]) * 100
    group = r["heads"] // r["kv_heads"]
    tokens = [f"{t['pos']} {t.get('text', t['id'])!s}".replace("\n", "\\n") for t in r["tokens"]]
    heads = [f"q{h} (kv{h // group})" for h in range(r["heads"])]
    _heatmap(fig, ax, weights, tokens[: weights.shape[1]], heads, "attention %")
    ax.set_title(f"layer {r['attention']['layer']}: attention of the last query "
                 f"(position {r['attention']['query_pos']}) over the cache")


def _block_map(fig, ax, r: dict[str, Any]) -> None:
    """One row per sequence, one cell per entry of its block table, coloured by the block's reference
    count and labelled with its number; a last row shows the whole pool (free blocks blank)."""
    import numpy as np

    refs = r["refcounts"]
    width = max([len(s["table"]) for s in r["blocks"]] + [1])
    rows = len(r["blocks"])
    grid = np.full((rows + 1, max(width, r["pool_blocks"])), np.nan)
    for i, seq in enumerate(r["blocks"]):
        for j, block in enumerate(seq["table"]):
            grid[i, j] = refs[block]
            if grid.shape[1] <= 48:
                ax.text(j, i, str(block), ha="center", va="center", fontsize=7)
    for block in range(r["pool_blocks"]):
        grid[rows, block] = refs[block] if block not in set(r["free_blocks"]) else np.nan
    image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0,
                      vmax=max([*refs, 1]))
    fig.colorbar(image, ax=ax, label="sequences sharing the block")
    ax.set_yticks(range(rows + 1), [f"seq {s['sequence']}" for s in r["blocks"]] + ["pool"], fontsize=7)
    ax.set_xlabel("block-table entry (pool row: block number; blank: free)")
    ax.set_title(f"block pool: {r['pool_blocks']} blocks of {r['block_size']} tokens, "
                 f"{len(r['shared_blocks'])} shared, {len(r['free_blocks'])} free")
