"""A mixed load (`kv-bench --mixed-load`): B sequences decoding while a long prompt arrives, run through
the scheduler with a per-step token budget (chunked prefill) and without one, side by side. With no
budget the long prompt is computed in one step and every decoding sequence waits for it; with one, its
chunks share each step with the decode tokens, so the gap between a sequence's tokens stays even."""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from inferno.runtime.engine import Engine


def run_mixed(engine: Engine, short_ids: list[int], long_ids: list[int], decoders: int, new_tokens: int,
              step_tokens: int | None) -> dict[str, Any]:
    """`decoders` greedy requests of short_ids; once all decode, a request of long_ids arrives. The
    decoders' inter-token gaps from then until they end, and the long prompt's time to first token."""
    from inferno.runtime.scheduler import Request

    scheduler = engine.scheduler("paged", max_batch=decoders + 1, step_tokens=step_tokens,
                                 pool_tokens=decoders * (len(short_ids) + new_tokens) + len(long_ids) + 8)
    ids = [scheduler.add(Request(short_ids, new_tokens, ignore_eos=True)) for _ in range(decoders)]
    times: dict[int, list[float]] = {i: [] for i in ids}
    long_id, arrived = None, None
    steps = 0
    while scheduler.has_work:
        if long_id is None and all(times[i] for i in ids):
            long_id = scheduler.add(Request(long_ids, 2, ignore_eos=True))
            arrived = perf_counter()
        for event in scheduler.step():
            if event.token is not None and event.request_id in times:
                times[event.request_id].append(perf_counter())
        steps += 1
    # every gap that ends after the long prompt arrived: the one spanning its first step included
    gaps = np.array([b - a for i in ids for a, b in zip(times[i], times[i][1:], strict=False)
                     if b > arrived])
    long_run = scheduler.get(long_id).metrics
    gaps_ms = gaps * 1000
    median, p99 = float(np.median(gaps_ms)), float(np.percentile(gaps_ms, 99))
    return {
        "step_tokens": step_tokens,
        "itl_median_ms": median,
        "itl_p99_ms": p99,
        "itl_max_ms": float(gaps_ms.max()),
        "p99_over_median": p99 / median,
        "long_prompt_ttft_ms": long_run.ttft_ms,
        "decode_tok_s": len(gaps) / gaps.sum() * decoders if gaps.sum() else None,
        "steps": steps,
        # the first sequence's gaps in order, from the one spanning the long prompt's arrival on
        "itl_ms": [1000 * (b - a) for a, b in zip(times[ids[0]], times[ids[0]][1:], strict=False)
                   if b > arrived],
    }


def mixed_load(engine: Engine, short_ids: list[int], long_ids: list[int], decoders: int, new_tokens: int,
               budgets: list[int | None], rounds: int = 1) -> list[dict[str, Any]]:
    """One row per budget (None: no chunking), each the median round of `rounds` by ITL p99; a first
    short round per budget warms the kernels it picks."""
    rows = []
    for budget in budgets:
        run_mixed(engine, short_ids, long_ids[: max(64, (budget or 64) * 2)], decoders, 4, budget)
        runs = sorted((run_mixed(engine, short_ids, long_ids, decoders, new_tokens, budget)
                       for _ in range(rounds)), key=lambda r: r["itl_p99_ms"])
        rows.append(runs[len(runs) // 2])
    return rows
