"""What batched decoding buys (`kv-bench --batch-sweep`): for each batch size B, one prompt prefilled
once and forked into B sequences sharing its blocks, each decoding the same number of greedy tokens
together (llama-batched-bench's shared-prompt mode); aggregate and per-sequence decode tok/s and the
cache bytes, the prompt held once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inferno.errors import InfernoError
from inferno.kv.paged import BLOCK_SIZE, ITEMSIZE

if TYPE_CHECKING:
    from inferno.batching import BatchRun
    from inferno.engine import Engine  # loading it pulls in the model and its kernels


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
) -> BatchRun:
    """One prompt prefilled once, `batch` greedy continuations of new_tokens decoded together."""
    from inferno import batching
    from inferno.sampling import Sampler

    engine.make_cache(None, len(prompt_ids), new_tokens)  # refuses what the model cannot hold
    pool = batching.samples_pool(engine.config.kv_geometry, len(prompt_ids), new_tokens, batch, block_size)
    requests = [batching.Request(prompt_ids, new_tokens, Sampler()) for _ in range(batch)]
    return batching.run(engine.model, requests, pool, batching.samples_start(engine.model, pool), batch)


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
        tokens = {tuple(done.token_ids) for done in result.completions}
        rows.append({
            "batch": batch,
            "decode_tok_s": result.decode_tok_s,  # all sequences together
            "per_sequence_tok_s": result.decode_tok_s / batch if result.decode_tok_s else None,
            "step_ms": result.decode_ms / result.steps if result.steps else None,
            "decode_steps": result.steps,
            "prefill_ms": result.completions[0].prefill_ms,
            "prompt_bytes": result.start_cache_bytes,  # held once, before the first step
            "peak_cache_bytes": result.peak_cache_bytes,
            "unshared_peak_bytes": batch * geometry.nbytes(len(prompt_ids) + new_tokens, ITEMSIZE),
            "identical_tokens": len(tokens) == 1,  # greedy: every sequence continues the same way
        })
    return rows
