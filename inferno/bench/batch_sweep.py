"""What batched decoding buys (`kv-bench --batch-sweep`): for each batch size B, B requests of one
prompt through the scheduler in a paged pool (the prompt's full blocks computed once and shared), each
decoding the same number of greedy tokens together (llama-batched-bench's shared-prompt mode);
aggregate and per-sequence decode tok/s and the cache bytes, the prompt held once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inferno.errors import InfernoError
from inferno.kv.pool import BLOCK_SIZE, ITEMSIZE

if TYPE_CHECKING:
    from inferno.cli.generate_many import Run
    from inferno.runtime.engine import Engine  # loading it pulls in the model and its kernels


def parse_sizes(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]: whole numbers of at least 1."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise InfernoError(f"batch sizes are whole numbers separated by commas, got {text!r}") from None
    if any(size < 1 for size in sizes):
        raise InfernoError(f"batch sizes must be at least 1, got {text!r}")
    return sizes


def run_samples(
    engine: Engine, prompt_ids: list[int], new_tokens: int, batch: int, block_size: int
) -> Run:
    """`batch` greedy continuations of one prompt, new_tokens each, run together."""
    from inferno.cli.generate_many import pool_tokens, run_all
    from inferno.runtime.scheduler import Request

    requests = [Request(prompt_ids, new_tokens, ignore_eos=True) for _ in range(batch)]
    scheduler = engine.scheduler("paged", max_batch=batch, pool_tokens=pool_tokens(requests, batch),
                                 block_size=block_size)
    return run_all(scheduler, requests)


def batch_sweep(
    engine: Engine, prompt_ids: list[int], new_tokens: int, sizes: list[int], block_size: int = BLOCK_SIZE
) -> list[dict[str, Any]]:
    """One row per batch size. Each size first runs one decode step unmeasured, so the row times the
    steady state, not the loading of the kernels its batch size picks (matrix-vector or BLAS)."""
    if new_tokens < 2:
        raise InfernoError(f"a sweep needs at least 2 new tokens per sequence (the first comes from the "
                           f"prefill), got {new_tokens}")
    geometry = engine.config.kv_geometry
    rows = []
    for batch in sizes:
        run_samples(engine, prompt_ids, 2, batch, block_size)  # warm-up
        result = run_samples(engine, prompt_ids, new_tokens, batch, block_size)
        tokens = {tuple(g.token_ids) for g in result.generations}
        steps = result.decode_steps
        rows.append({
            "batch": batch,
            "decode_tok_s": result.decode_tok_s,  # all sequences together
            "per_sequence_tok_s": result.decode_tok_s / batch if result.decode_tok_s else None,
            "step_ms": result.decode_ms / steps if steps else None,
            "decode_steps": steps,
            "prefill_ms": result.generations[0].metrics.prefill_ms,
            "start_cache_bytes": result.start_cache_bytes,  # held when every sequence decodes
            "reused_tokens": sum(g.metrics.reused_tokens for g in result.generations),
            "peak_cache_bytes": result.peak_cache_bytes,
            "unshared_peak_bytes": batch * geometry.nbytes(len(prompt_ids) + new_tokens, ITEMSIZE),
            "identical_tokens": len(tokens) == 1,  # greedy: every sequence continues the same way
        })
    return rows
