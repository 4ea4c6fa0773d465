"""inferno against llama.cpp's llama-bench on one model file, side by side in one run: decode at depth 0
(float32-exact and int8 activations) and 2048, prefill of 512 tokens (both), a first and a later run's whole
process time and peak RSS; and the exact prefill as a fraction of the float32 peak, a plain sgemm of
its weight products (inferno.bench.sgemm_peak). Every measurement is its own process; rounds alternate
the two engines; the table gives medians, and beside them the lowest and highest of the rounds' own
ratios (each round's pair ran minutes apart at most: on a shared host their spread is the noise). Each
round starts with a plain read of memory (inferno.bench.host_read), printed last: how busy the host
was, which moves these ratios more than most changes do.

    python -m inferno.bench.versus_llama MODEL.gguf --llama-bench PATH [--rounds 3] [--threads 2]

Whole process: `model-generate` of a 16-token prompt and 16 new tokens against `llama-bench -pg 16,16
--no-warmup -r 1`, which loads the model, reads a 16-token prompt and generates 16 tokens: the same work
(llama.cpp's warm-up is skipped; inferno's counts in its time). A first run starts with an empty
prepared-model cache (Numba's kernel cache warm, as after installing); a later run finds the entry.

Peak RSS is each child's own from wait4, but Linux starts a child's count at its parent's high-water
mark, so this process stays small: the prompts (a tokenizer of 262,144 tokens peaks at half a GB) and
the host's read are made in children of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from inferno.bench import host_read, sgemm_peak
from inferno.bench.processes import aside
from inferno.bench.prompts import write_exact_prompts


def run(cmd: list[str], env: dict | None = None) -> tuple[str, float, int]:
    """stdout, wall seconds and peak RSS (bytes) of one process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"versus_llama: {' '.join(cmd[:3])} ... exited {proc.returncode}")
    return out, time.perf_counter() - t0, usage.ru_maxrss * 1024


def inferno(model: str, prompt_file: Path, new: int, threads: int, extra: list[str], env: dict) -> dict:
    cmd = [sys.executable, "-m", "inferno.cli.generate", model, "--prompt-file", str(prompt_file), str(new),
           "--kv", "prealloc", "--ignore-eos", "--threads", str(threads), "--json", *extra]
    out, wall, rss = run(cmd, env)
    metrics = json.loads(out)["metrics"]
    return {"decode": 1000 / metrics["tpot_ms"] if metrics.get("tpot_ms") else None,
            "prefill": metrics["prefill_tok_s"], "wall": wall, "rss": rss}


def llama(binary: str, model: str, threads: int, prompt: int, new: int, depth: int = 0,
          extra: tuple[str, ...] = ()) -> dict:
    cmd = [binary, "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(new), "-d", str(depth),
           "-r", "1", "-o", "jsonl", *extra]
    out, wall, rss = run(cmd)
    rate = json.loads(out.strip().splitlines()[-1])["avg_ts"]
    return {"decode" if new else "prefill": rate, "wall": wall, "rss": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--llama-bench", required=True, help="path to llama.cpp's llama-bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="versus-"))
    prompts = {n: work / f"p{n}.txt" for n in (16, 512, 2048)}
    aside(write_exact_prompts, args.model, {path: n for n, path in prompts.items()})
    cache = work / "model-cache"
    warm = dict(os.environ, INFERNO_CACHE_DIR=str(cache))
    inferno(args.model, prompts[16], 2, args.threads, [], warm)  # the entry and the kernels, once
    rows: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, ours: float, theirs: float) -> None:
        rows.setdefault(name, []).append((ours, theirs))

    t, b = args.threads, args.llama_bench
    peak: list[tuple[float, dict]] = []  # the exact prefill's tok/s, and a plain sgemm of its products
    reads = []  # GB/s of a plain read, each round
    for _ in range(args.rounds):
        reads.append(aside(host_read.read_rate, t))
        ours, theirs = inferno(args.model, prompts[16], 64, t, [], warm), llama(b, args.model, t, 0, 64)
        add("decode tok/s, depth 0", ours["decode"], theirs["decode"])
        int8 = inferno(args.model, prompts[16], 64, t, ["--activations", "int8"], warm)  # as llama.cpp rounds
        add("decode tok/s, depth 0, --activations int8", int8["decode"], theirs["decode"])
        ours = inferno(args.model, prompts[2048], 32, t, [], warm)
        add("decode tok/s, depth 2048", ours["decode"], llama(b, args.model, t, 0, 32, 2048)["decode"])
        theirs = llama(b, args.model, t, 512, 0)
        exact = inferno(args.model, prompts[512], 1, t, [], warm)["prefill"]
        add("prefill 512 tok/s, exact", exact, theirs["prefill"])
        peak.append((exact, sgemm_peak.in_process(args.model, 512, t)))
        int8 = inferno(args.model, prompts[512], 1, t, ["--activations", "int8"], warm)
        add("prefill 512 tok/s, --activations int8", int8["prefill"], theirs["prefill"])
        empty = work / f"empty-{time.monotonic_ns()}"
        theirs = llama(b, args.model, t, 0, 0, extra=("-pg", "16,16", "--no-warmup"))  # as model-generate's
        ours = inferno(args.model, prompts[16], 16, t, [], dict(os.environ, INFERNO_CACHE_DIR=str(empty)))
        shutil.rmtree(empty)  # before the kernel writes its dirty pages back during the next measurements
        add("first run, whole process s", ours["wall"], theirs["wall"])
        later = inferno(args.model, prompts[16], 16, t, [], warm)
        add("later run, whole process s", later["wall"], theirs["wall"])
        add("peak RSS MiB (later run)", later["rss"] / 2**20, theirs["rss"] / 2**20)
    print(f"{Path(args.model).name}, {t} threads, medians of {args.rounds} rounds")
    print(f"{'':42} {'inferno':>9} {'llama.cpp':>10} {'ratio':>7} {'rounds':>11}")
    for name, pairs in rows.items():
        ours, theirs = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        each = [o / t for o, t in pairs]
        print(f"{name:42} {ours:9.1f} {theirs:10.1f} {ours / theirs:6.2f}x {min(each):5.2f}-{max(each):.2f}x")
    fraction = statistics.median(exact / sgemm["tok_s"] for exact, sgemm in peak)
    gflop_s = statistics.median(sgemm["gflop_s"] for _, sgemm in peak)
    print(f"exact prefill of 512: {fraction:.0%} of the float32 peak (a plain sgemm of its weight products: "
          f"{gflop_s:.0f} GFLOP/s)")
    print(f"the host: a plain read of {host_read.READ_MIB} MiB on {t} threads at "
          f"{statistics.median(reads):.1f} GB/s (rounds {min(reads):.1f}-{max(reads):.1f})")
    shutil.rmtree(work)  # the prompts and the warm model cache (the size of the model)


if __name__ == "__main__":
    main()
