"""The machine's float32 peak on a prefill's own matrix products: a plain sgemm (numpy's BLAS) of every
weight product a prompt of N tokens makes, with the model's shapes, timed at a thread count. The
fraction of it that inferno's exact prefill reaches is the "exact path near the float32 peak" figure
of docs/benchmarks.md.

    python -m inferno.bench.sgemm_peak MODEL.gguf [--tokens 512] [--threads 2] [--rounds 5]

Prints JSON: the products' GFLOP, the best round's seconds, GFLOP/s, and the prefill tok/s that
time would allow (tokens / seconds): an upper bound no prefill that multiplies in float32 can pass.
Run it in its own process: BLAS takes its thread count from the environment when it loads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from inferno.file.config import ModelConfig
from inferno.file.reader import open_gguf


def product_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of each weight product of one layer: q, k and v stacked, the attention output, gate
    and up stacked, down. The output matrix is left out: a prefill takes logits of its last token only."""
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    h, f = config.hidden_size, config.ffn_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * f), (f, h)]


def measure(config: ModelConfig, tokens: int, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    shapes = product_shapes(config)
    xs = {n: rng.standard_normal((tokens, n), dtype=np.float32) for n, _ in shapes}
    ws = [(n, rng.standard_normal((m, n), dtype=np.float32)) for n, m in shapes]  # [out, in], as the file
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for n, w in ws:
            xs[n] @ w.T
        best = min(best, (time.perf_counter() - t) * config.n_layers)
    gflop = 2 * tokens * sum(n * m for n, m in shapes) * config.n_layers / 1e9
    return {"gflop": gflop, "seconds": best, "gflop_s": gflop / best, "tok_s": tokens / best}


def in_process(model: str, tokens: int, threads: int, rounds: int = 5) -> dict:
    """`measure` in a fresh process whose BLAS runs `threads` threads."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "inferno.bench.sgemm_peak", model, "--tokens", str(tokens),
           "--threads", str(threads), "--rounds", str(rounds)]
    return json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if os.environ.get("OPENBLAS_NUM_THREADS") != str(args.threads):
        print(json.dumps(in_process(args.model, args.tokens, args.threads, args.rounds)))
        return
    print(json.dumps(measure(ModelConfig.from_gguf(open_gguf(args.model)), args.tokens, args.rounds)))


if __name__ == "__main__":
    main()
