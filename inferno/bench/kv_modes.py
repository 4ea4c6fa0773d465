"""What a KV cache buys (`kv-bench`): one prompt generated with no cache and with each cache layout, side
by side in one process, and the figures that show it: per-forward time climbs without a cache and stays
flat with one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inferno.kv import DEFAULT_DTYPE, LAYOUTS

if TYPE_CHECKING:
    from inferno.runtime.engine import Engine  # loading it pulls in the model and its kernels

MODES = ("off", *LAYOUTS)  # off: no cache, every step reruns the whole sequence
DEFAULT_MODES = ("off", "basic", "prealloc")  # the others take options of their own (--window, paged's pool)


def run_modes(
    engine: Engine, prompt_ids: list[int], new_tokens: int, modes: tuple[str, ...],
    dtypes: tuple[str, ...] = (DEFAULT_DTYPE,),
) -> dict[str, Any]:
    """Run each mode, and each layout with each element type it holds, on the same prompt (greedy, no
    early stop): `mode` (or `mode/dtype` when several element types run) -> its token ids and metrics."""
    results = {}
    for mode in modes:
        for dtype in (None,) if mode == "off" else [d for d in dtypes if d in LAYOUTS[mode].dtypes]:
            label = mode if dtype is None or dtypes == (DEFAULT_DTYPE,) else f"{mode}/{dtype}"
            layout = None if mode == "off" else mode
            cache = engine.make_cache(layout, len(prompt_ids), new_tokens, dtype=dtype or DEFAULT_DTYPE)
            done = engine.run(prompt_ids, new_tokens, kv=layout, cache=cache, ignore_eos=True)
            results[label] = {"token_ids": done.token_ids, "metrics": done.metrics.to_json()}
    return results


def summary_row(metrics: dict[str, Any], window: int) -> dict[str, Any]:
    """The figures the table shows, with the flatness ratio: last `window` decodes over the first."""
    decodes = metrics["per_forward_ms"][1:]
    n = min(window, len(decodes) // 2) or 1
    first, last = decodes[:n], decodes[-n:]
    return {
        "ttft_ms": metrics["ttft_ms"],
        "decode_tok_s": metrics["decode_tok_s"],
        "first_forward_ms": sum(first) / len(first) if decodes else None,
        "last_forward_ms": sum(last) / len(last) if decodes else None,
        "last_over_first": (sum(last) / sum(first)) if decodes else None,
        "cache_bytes": metrics["cache_bytes"],
    }
