"""Benchmark inferno.kernels.quant's matrix-vector kernels on the real model's weights.

For each matrix: QuantizedMatrix.matvec against float32 np.dot on the dequantized matrix, timed side
by side (interleaved, best of several batches), at each thread count, with the weight bytes read per
second. Each thread count runs in its own process so OpenBLAS gets the same count as Numba. Also
reports the JIT cold-compile time (fresh Numba cache), the whole-model load/repack time and one decode
step's matvecs as the model makes them (weights streaming from memory), per block type and in all.

Run with the project's virtualenv python: `.venv/bin/python -m inferno.bench.matvec`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from inferno.cli.common import default_model
from inferno.errors import InfernoError

# (tensor, label): the 576x576, 1536x576 and 576x1536 Q4_1 matrices and the Q8_0 embedding/output.
MATRICES = [
    ("blk.0.attn_q.weight", "attn_q"),
    ("blk.0.ffn_up.weight", "ffn_up"),
    ("blk.0.ffn_down.weight", "ffn_down"),
    ("token_embd.weight", "token_embd"),
]


def best_of(fns, seconds: float) -> list[float]:
    """Seconds per call of each fn: the best batch average, batches of each fn interleaved."""
    for fn in fns:
        fn()
    t0 = time.perf_counter()
    fns[0]()
    calls = max(1, int(0.02 / max(time.perf_counter() - t0, 1e-7)))  # about 20 ms per batch
    best = [float("inf")] * len(fns)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[k] = min(best[k], (time.perf_counter() - t0) / calls)
    return best


def rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    except (OSError, StopIteration):
        return float("nan")


def compile_worker(model: Path) -> None:
    """Time the first call of every kernel for the model's weight types (run with an empty cache)."""
    import numpy as np

    t0 = time.perf_counter()
    from inferno.file.reader import open_gguf
    from inferno.kernels import quant

    print(f"  import inferno.kernels.quant: {time.perf_counter() - t0:.2f} s")
    reader = open_gguf(model)
    seen = {}
    for t in reader.tensors:
        if len(t.shape) == 2 and t.tensor_type not in seen:
            seen[t.tensor_type] = t
    total = 0.0
    for qtype, tensor in seen.items():
        m = quant.QuantizedMatrix.from_tensor(tensor)
        x = np.ones(m.cols, np.float32)
        t0 = time.perf_counter()
        m.matvec(x)
        t1 = time.perf_counter()
        m.rows_at(np.array([0, 1]))
        t2 = time.perf_counter()
        m.matmul(np.ones((quant.MATMUL_MIN_ROWS, m.cols), np.float32))  # compiles dequantize_transposed
        t3 = time.perf_counter()
        total += t3 - t0
        print(f"  {qtype.name}: matvec {t1 - t0:.2f} s, rows_at {t2 - t1:.2f} s, "
              f"dequantize/matmul {t3 - t2:.2f} s")
    print(f"  total first-call compile: {total:.2f} s")


def bench_worker(model: Path, threads: int, seconds: float) -> None:
    import numba
    import numpy as np

    from inferno.file.reader import open_gguf
    from inferno.kernels import quant
    from inferno.model.transformer import Transformer

    numba.set_num_threads(threads)
    reader = open_gguf(model)
    tensors = {t.name: t for t in reader.tensors}
    rng = np.random.default_rng(0)
    print(f"threads={threads}")
    print(f"  {'matrix':12s} {'type':5s} {'shape':>11s} {'quant ms':>9s} {'GB/s':>6s} {'np.dot ms':>10s} "
          f"{'ratio':>6s}")
    for name, label in MATRICES:
        m = quant.QuantizedMatrix.from_tensor(tensors[name])
        w = m.dequantize()
        x = rng.standard_normal(m.cols).astype(np.float32)
        out = np.empty(m.rows, np.float32)
        ours, ref = best_of([lambda m=m, x=x, out=out: m.matvec(x, out), lambda w=w, x=x: w @ x], seconds)
        shape = f"{m.rows}x{m.cols}"
        print(f"  {label:12s} {m.qtype.name:5s} {shape:>11s} {ours * 1e3:9.3f} {m.nbytes / ours / 1e9:6.1f} "
              f"{ref * 1e3:10.3f} {ours / ref:6.2f}")
    # The matvecs of one decode step, as the model makes them (stacked q/k/v and gate/up, output last),
    # weights streaming from memory: each block type's share, then the whole pass against float32 np.dot.
    rss0 = rss_mb()
    t0 = time.perf_counter()
    model = Transformer.from_gguf(reader)
    load = time.perf_counter() - t0
    rss1 = rss_mb()
    mats = [*model.layer_matrices(), model.output]
    stored = sum(m.nbytes for m in mats) / 2**20
    xs = [rng.standard_normal(m.cols).astype(np.float32) for m in mats]
    outs = [np.empty(m.rows, np.float32) for m in mats]

    def quant_pass(qtype=None):
        def run():
            for m, x, out in zip(mats, xs, outs, strict=True):
                if qtype is None or m.qtype == qtype:
                    m.matvec(x, out)
        return run

    for qtype in sorted({m.qtype for m in mats}):
        nbytes = sum(m.nbytes for m in mats if m.qtype == qtype)
        (ours,) = best_of([quant_pass(qtype)], seconds)
        calls = sum(m.qtype == qtype for m in mats)
        print(f"  {'pass: ' + qtype.name:12s} {qtype.name:5s} {calls:>8d} mx {ours * 1e3:9.3f} "
              f"{nbytes / ours / 1e9:6.1f}")
    dense = [m.dequantize() for m in mats]

    def dense_pass():
        for w, x in zip(dense, xs, strict=True):
            w @ x

    ours, ref = best_of([quant_pass(), dense_pass], seconds * 2)
    print(f"  {'decode pass':12s} {'mixed':5s} {len(mats):>8d} mx {ours * 1e3:9.3f} "
          f"{stored * 2**20 / ours / 1e9:6.1f} {ref * 1e3:10.3f} {ours / ref:6.2f}"
          f"   -> matvec-only ceiling {1 / ours:.0f} tok/s")
    if threads == 1:
        print(f"  model load+repack: {load:.2f} s, {stored:.1f} MiB of matrices, "
              f"resident +{rss1 - rss0:.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: the default model)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--seconds", type=float, default=2.0, help="timing budget per comparison")
    ap.add_argument("--no-compile", action="store_true", help="skip the cold-compile measurement")
    ap.add_argument("--worker", choices=["compile", "bench"], help=argparse.SUPPRESS)
    ap.add_argument("--nthreads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        args.model = args.model or default_model()
    except InfernoError as bad:
        sys.exit(f"bench-matvec: error: {bad}")
    if not args.model.exists():
        sys.exit(f"bench-matvec: error: {args.model} not found (make model fetches it)")
    if args.worker == "compile":
        return compile_worker(args.model)
    if args.worker == "bench":
        return bench_worker(args.model, args.nthreads, args.seconds)

    me = [sys.executable, "-m", "inferno.bench.matvec", "--model", str(args.model)]
    if not args.no_compile:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "NUMBA_CACHE_DIR": cache}
            print("JIT cold compile (empty Numba cache):")
            subprocess.run([*me, "--worker", "compile"], env=env, check=True)
            print("Same again with the cache filled:")
            subprocess.run([*me, "--worker", "compile"], env=env, check=True)
    for n in (int(v) for v in args.threads.split(",")):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": str(n)}
        cmd = [*me, "--worker", "bench", "--nthreads", str(n), "--seconds", str(args.seconds)]
        subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
