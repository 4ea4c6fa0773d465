"""model-generate beside busy neighbours: decode speed with 0, 1 and 2 other processes spinning on the
cores, the default (threads chosen by measuring) beside fixed `--threads` counts, rounds alternating
every setting, medians. Also the whole process's wall time of a 32-token run.

    python -m inferno.bench.under_load [MODEL] [--rounds 3] [--busy 0,1,2] [--fixed 2,1] [--json]

A neighbour is `python -c "while True: pass"`: one process that wants a core all the time, as a
compiler or a second model does. Run it on an otherwise quiet machine: the quiet rounds are the
reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

from inferno.bench.versus_llama import run

PROMPT = "Once upon a time"


@contextmanager
def neighbours(n: int):
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.3)  # until they spin
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def generate(model: str, tokens: int, threads: int | None) -> tuple[dict, float]:
    """The run's metrics and its whole process's wall seconds."""
    cmd = [sys.executable, "-m", "inferno.cli.generate", model, PROMPT, str(tokens), "--kv", "prealloc",
           "--ignore-eos", "--json", *(["--threads", str(threads)] if threads else [])]
    out, wall, _ = run(cmd)
    return json.loads(out)["metrics"], wall


def measure(model: str, rounds: int, busy: list[int], fixed: list[int], tokens: int) -> list[dict]:
    settings = [None, *fixed]
    got: dict[tuple[int, int | None], dict[str, list[float]]] = {}
    for rnd in range(rounds):
        for b in busy:
            for threads in settings:
                with neighbours(b):
                    metrics, _ = generate(model, tokens, threads)
                    _, wall32 = generate(model, 32, threads)
                cell = got.setdefault((b, threads), {"decode": [], "wall32": [], "threads": []})
                cell["decode"].append(metrics["decode_tok_s"])
                cell["wall32"].append(wall32)
                cell["threads"].append(metrics["threads"])
                print(f"round {rnd + 1}: busy {b}, threads {threads or 'measured'}: "
                      f"{metrics['decode_tok_s']:.1f} tok/s, 32 tokens in {wall32:.2f} s", file=sys.stderr)
    quiet = statistics.median(got[0 if 0 in busy else busy[0], None]["decode"])
    return [{"busy": b, "threads": t or "measured", "decode_tok_s": statistics.median(c["decode"]),
             "of_quiet": statistics.median(c["decode"]) / quiet, "wall32_s": statistics.median(c["wall32"]),
             "last_threads": c["threads"]}
            for (b, t), c in got.items()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", default="0,1,2", help="neighbour counts, comma-separated")
    parser.add_argument("--fixed", default="2,1", help="fixed --threads counts beside the default")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = measure(args.model, args.rounds, _ints(args.busy), _ints(args.fixed), args.tokens)
    if args.json:
        print(json.dumps(rows))
        return
    print("| busy | threads | decode tok/s | of quiet (measured) | 32 tokens, whole process | threads used |")
    print("| ---: | --- | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['busy']} | {r['threads']} | {r['decode_tok_s']:.1f} | {r['of_quiet']:.0%} "
              f"| {r['wall32_s']:.2f} s | {','.join(map(str, r['last_threads']))} |")


if __name__ == "__main__":
    main()
