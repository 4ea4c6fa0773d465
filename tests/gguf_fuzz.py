"""A GGUF fuzzer: seeded mutations of the tiny fixture models, each fed to model-generate.

Every case must end in a clean refusal (exit code 2 and one line on stderr) or a successful run;
anything else (a traceback, another exit code, a crash of the process) is a failure. Cases run in
batches inside worker processes, so a hard crash (segfault, abort) kills only its worker: the cases
that worker had not finished run again, the one it died on alone in its own process.

    python tests/gguf_fuzz.py --cases 5000            # what `make fuzz` runs, with NUMBA_BOUNDSCHECK=1

A case is (fixture, seed): the same pair always makes the same file. The fixtures are the tiny models
(float32, float16 and Q8_0 weights) and tiny_kquant (Q4_K and Q6_K blocks of a real Q4_K_M file, an
untied output). The mutations: metadata integers set to 0 / -1 / 2**32+1 / 2**63 / off by one, values
of another type, strings that are not UTF-8, keys removed, tensor shapes swapped or changed, tensor
types changed, matrices re-typed to random blocks of any type inferno runs, tensors dropped or renamed,
NaN/Inf written into weights, and after serialising, bytes flipped in the header, metadata and tensor
table, or the file cut short.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import resource
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODELS = ("tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_kquant")  # kquant: Q4_K and Q6_K, untied
ALIGNMENT = 32
PROG = "model-generate"
MEMORY_LIMIT = 3 << 30  # address space of a worker: ~10x what running a tiny model takes

# -- a GGUF as plain data, and back to bytes ------------------------------------------------------

SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
INT_TYPES = {t for t, f in SCALAR_FORMATS.items() if f in "BbHhIiQq"}


@dataclass
class Tensor:
    name: str
    shape: list[int]  # GGML order, contiguous dimension first
    type: int
    data: bytes


@dataclass
class Model:
    fields: list[list]  # [key, type, value] or [key, ARRAY, (item type, values)]
    tensors: list[Tensor] = field(default_factory=list)


def read_model(path: Path) -> Model:
    reader = GGUFReader(path)
    model = Model([])
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            model.fields.append([key, GGUFValueType.ARRAY, (f.types[1], f.contents())])
        else:
            model.fields.append([key, f.types[0], f.contents()])
    for t in reader.tensors:
        raw = bytes(reader.data[t.data_offset : t.data_offset + t.n_bytes])
        model.tensors.append(Tensor(t.name, [int(n) for n in t.shape], int(t.tensor_type), raw))
    return model


def _string(value: str | bytes) -> bytes:
    raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value) -> bytes:
    if vtype == GGUFValueType.STRING:
        return _string(value)
    if vtype == GGUFValueType.ARRAY:
        itype, items = value
        return struct.pack("<IQ", itype, len(items)) + b"".join(_value(itype, v) for v in items)
    fmt = SCALAR_FORMATS[GGUFValueType(vtype)]
    if fmt in "BbHhIiQq":
        bits = 8 * struct.calcsize(fmt)
        value = int(value) & ((1 << bits) - 1)  # -1 as an unsigned field is all ones
        fmt = fmt.upper()
    return struct.pack("<" + fmt, value)


def write_model(model: Model) -> bytes:
    out = [b"GGUF", struct.pack("<IQQ", 3, len(model.tensors), len(model.fields))]
    for key, vtype, value in model.fields:
        out += [_string(key), struct.pack("<I", vtype), _value(vtype, value)]
    offset = 0
    for t in model.tensors:
        out += [_string(t.name), struct.pack("<I", len(t.shape)), struct.pack(f"<{len(t.shape)}Q", *t.shape),
                struct.pack("<IQ", t.type, offset)]
        offset += -(-len(t.data) // ALIGNMENT) * ALIGNMENT
    head = b"".join(out)
    head += b"\0" * (-len(head) % ALIGNMENT)
    body = b"".join(t.data + b"\0" * (-len(t.data) % ALIGNMENT) for t in model.tensors)
    return head + body


# -- mutations ------------------------------------------------------------------------------------

INT_VALUES = (0, -1, 2**32 + 1, 2**63, 1, 2, 3, 7, 2**31, 10**6)
DIM_VALUES = (0, 1, 2, 3, 31, 33, 2**32 + 1, 2**63)
TENSOR_TYPES = (0, 1, 2, 3, 6, 7, 8, 10, 12, 14, 20, 30, 99)  # F32 F16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 ... bogus
BLOCK_TYPES = tuple(GGMLQuantizationType[n] for n in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                                      "Q8_0", "Q4_K", "Q5_K", "Q6_K"))  # what inferno runs


def _int_field(rng: random.Random, m: Model) -> str:
    ints = [f for f in m.fields if f[1] in INT_TYPES]
    f = rng.choice(ints)
    value = rng.choice(INT_VALUES)
    f[2] = value
    if value < 0:
        f[1] = GGUFValueType.INT32 if rng.random() < 0.5 else GGUFValueType.INT64
    elif value >= 2**32:
        f[1] = GGUFValueType.UINT64
    return f"{f[0]} = {value}"


def _retype_field(rng: random.Random, m: Model) -> str:
    f = rng.choice([f for f in m.fields if f[1] != GGUFValueType.ARRAY])
    choices = {
        GGUFValueType.STRING: lambda v: str(v),
        GGUFValueType.FLOAT32: lambda v: float(v) if not isinstance(v, (str, bytes)) else 1.5,
        GGUFValueType.FLOAT64: lambda v: float("nan"),
        GGUFValueType.BOOL: lambda v: True,
        GGUFValueType.INT32: lambda v: -7,
        GGUFValueType.UINT64: lambda v: 2**64 - 1,
    }
    vtype = rng.choice(list(choices))
    f[1], f[2] = vtype, choices[vtype](f[2])
    return f"{f[0]} as {vtype.name}"


def _float_field(rng: random.Random, m: Model) -> str:
    f = rng.choice([f for f in m.fields if f[1] == GGUFValueType.FLOAT32])
    f[2] = rng.choice((0.0, -1.0, float("nan"), float("inf"), 1e-45, 1e38))
    return f"{f[0]} = {f[2]}"


def _bad_utf8(rng: random.Random, m: Model) -> str:
    f = rng.choice([f for f in m.fields if f[1] == GGUFValueType.STRING or
                    (f[1] == GGUFValueType.ARRAY and f[2][0] == GGUFValueType.STRING and f[2][1])])
    if f[1] == GGUFValueType.STRING:
        f[2] = b"\xff\xfe" + (f[2].encode() if isinstance(f[2], str) else f[2])[:3]
    else:
        items = list(f[2][1])
        items[rng.randrange(len(items))] = b"\xc3\x28"
        f[2] = (GGUFValueType.STRING, items)
    return f"{f[0]} not UTF-8"


def _array_field(rng: random.Random, m: Model) -> str:
    f = rng.choice([f for f in m.fields if f[1] == GGUFValueType.ARRAY])
    itype, items = f[2]
    how = rng.choice(("empty", "short", "long", "retype"))
    if how == "empty":
        items = []
    elif how == "short":
        items = items[: rng.randrange(len(items) + 1)]
    elif how == "long":
        items = items + items[: rng.randrange(1, 50)]
    else:
        itype, items = (GGUFValueType.INT32, [7] * len(items)) if itype == GGUFValueType.STRING else (
            GGUFValueType.STRING, [str(v) for v in items])
    f[2] = (itype, items)
    return f"{f[0]} {how}"


def _drop_field(rng: random.Random, m: Model) -> str:
    f = m.fields.pop(rng.randrange(len(m.fields)))
    return f"drop {f[0]}"


def _tensor_shape(rng: random.Random, m: Model) -> str:
    t = rng.choice(m.tensors)
    how = rng.choice(("swap", "dim", "flatten", "add_dim", "swap_tensors"))
    if how == "swap" and len(t.shape) == 2:
        t.shape.reverse()
    elif how == "dim":
        t.shape[rng.randrange(len(t.shape))] = rng.choice(DIM_VALUES)
    elif how == "flatten":
        t.shape = [int(np.prod(t.shape))]
    elif how == "add_dim":
        t.shape = [*t.shape, 1] if rng.random() < 0.5 else [1, *t.shape]
    else:
        other = rng.choice(m.tensors)
        t.shape, other.shape = other.shape, t.shape
        return f"shapes of {t.name} and {other.name} swapped"
    return f"{t.name} shape {how} -> {t.shape}"


def _tensor_type(rng: random.Random, m: Model) -> str:
    t = rng.choice(m.tensors)
    t.type = rng.choice(TENSOR_TYPES)
    return f"{t.name} type {t.type}"


def _tensor_blocks(rng: random.Random, m: Model) -> str:
    """A matrix re-typed, its data random bytes of the new type's size: garbage blocks (NaN, Inf and huge
    scales among them) that the repacking and the integer dots must take, or refuse in one line."""
    matrices = [t for t in m.tensors if len(t.shape) == 2 and 0 < t.shape[0] * t.shape[1] <= 1 << 24]
    if not matrices:  # an earlier mutation left none of a size to fill
        return "no matrix to re-type"
    t = rng.choice(matrices)
    qtype = rng.choice([q for q in BLOCK_TYPES if t.shape[0] % GGML_QUANT_SIZES[q][0] == 0])
    block, size = GGML_QUANT_SIZES[qtype]
    t.type, t.data = int(qtype), rng.randbytes(t.shape[0] // block * size * t.shape[1])
    return f"{t.name} as random {qtype.name} blocks"


def _tensor_set(rng: random.Random, m: Model) -> str:
    i = rng.randrange(len(m.tensors))
    t = m.tensors[i]
    how = rng.choice(("drop", "rename", "duplicate", "nan", "inf", "huge"))
    if how == "drop":
        m.tensors.pop(i)
    elif how == "rename":
        t.name = rng.choice(("blk.9.attn_q.weight", "output.weight", t.name + "x", "blk.0.attn_q.bias"))
    elif how == "duplicate":
        m.tensors.append(Tensor(t.name, list(t.shape), t.type, t.data))
    else:
        value = {"nan": np.float32("nan"), "inf": np.float32("inf"), "huge": np.float32(3e38)}[how]
        data = bytearray(t.data)
        at = rng.randrange(len(data) // 4) * 4
        data[at : at + 4] = value.tobytes() if t.type == 0 else b"\xff\x7f\xff\x7f"  # f16 NaN scale bits
        t.data = bytes(data)
    return f"{t.name} {how}"


STRUCTURED = (_int_field, _int_field, _retype_field, _float_field, _bad_utf8, _array_field, _drop_field,
              _tensor_shape, _tensor_shape, _tensor_type, _tensor_blocks, _tensor_set)


def make_case(name: str, seed: int) -> tuple[bytes, str]:
    """The mutated file of case (fixture `name`, `seed`) and what was done to it."""
    rng = random.Random(f"{name}:{seed}")
    model = read_model(FIXTURES / f"{name}.gguf")
    done = [rng.choice(STRUCTURED)(rng, model) for _ in range(rng.choice((1, 1, 1, 2, 3)))]
    data = bytearray(write_model(model))
    header_end = len(data) - sum(-(-len(t.data) // ALIGNMENT) * ALIGNMENT for t in model.tensors)
    roll = rng.random()
    if roll < 0.25:  # flip bytes where the structure is: header, metadata, tensor table
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(4, header_end) if rng.random() < 0.8 else rng.randrange(4, 24)
            data[at] = rng.randrange(256)
        done.append("bytes flipped")
    elif roll < 0.33:
        data = data[: rng.randrange(len(data))]
        done.append(f"cut at {len(data)}")
    return bytes(data), "; ".join(done)


# -- running cases --------------------------------------------------------------------------------

CASE_ARGS = (
    ("--json",),
    ("--kv", "basic"),
    ("--kv", "prealloc", "--json"),
    ("--kv", "prealloc", "--chat"),
)


def run_case(path: Path, seed: int) -> tuple[int, str]:
    """model-generate on the file, in this process: (exit code, stderr)."""
    from inferno.cli import generate

    args = [*CASE_ARGS[seed % len(CASE_ARGS)], str(path), "Hello world", "3"]
    err = io.StringIO()
    sys.argv = [PROG, *args]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            generate.main()
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
        except BaseException as exc:  # what the test exists to find: print what it was
            import traceback

            traceback.print_exc()
            code = f"exception {type(exc).__name__}"
    return code, err.getvalue()


def outcome(code, stderr: str) -> str:
    lines = stderr.strip().splitlines()
    if code == 0:
        return "ran"
    if code == 2 and len(lines) == 1 and lines[0].startswith(f"{PROG}: error: "):
        return "refused"
    return "other"


def worker(cases: list[tuple[str, int]], results: Path) -> None:
    """Run cases in this process, appending one JSON line per finished case to `results`."""
    # A file that makes the loader allocate without bound must fail here (MemoryError: a finding),
    # not take the machine's memory.
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    with tempfile.TemporaryDirectory() as tmp, results.open("a") as out:
        for name, seed in cases:
            if os.environ.get("GGUF_FUZZ_ABORT_ON") == f"{name}:{seed}":  # the harness's own test
                os.abort()
            data, what = make_case(name, seed)
            path = Path(tmp) / f"{name}-{seed}.gguf"
            path.write_bytes(data)
            t = time.perf_counter()
            code, stderr = run_case(path, seed)
            path.unlink()
            row = {"model": name, "seed": seed, "what": what, "outcome": outcome(code, stderr),
                   "code": code, "stderr": stderr[-2000:], "ms": (time.perf_counter() - t) * 1000}
            out.write(json.dumps(row) + "\n")
            out.flush()


def _spawn(cases: list[tuple[str, int]], results: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--worker", json.dumps(cases), str(results)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def _finished(results: Path) -> list[dict]:
    if not results.exists():
        return []
    return [json.loads(line) for line in results.read_text().splitlines() if line.endswith("}")]


def run_cases(cases: list[tuple[str, int]], workers: int = 2, timeout_s: float = 600,
              env: dict | None = None) -> list[dict]:
    """Every case's result row; a case that kills its worker gets outcome "crash" with its exit status."""
    env = dict(os.environ if env is None else env)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    rows: list[dict] = []
    pending = [cases[i::workers] for i in range(workers)]
    with tempfile.TemporaryDirectory() as tmp:
        env["INFERNO_CACHE_DIR"] = str(Path(tmp) / "prepared")  # each case's model, never the user's cache
        serial = 0
        while any(pending):
            jobs = []
            for batch in filter(None, pending):
                serial += 1
                results = Path(tmp) / f"results-{serial}.jsonl"
                jobs.append((batch, results, _spawn(batch, results, env)))
            pending = []
            for batch, results, proc in jobs:
                try:
                    _, stderr = proc.communicate(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    _, stderr = proc.communicate()
                done = _finished(results)
                rows += done
                if len(done) == len(batch):
                    continue
                failed, rest = batch[len(done)], batch[len(done) + 1 :]
                if len(batch) > 1:  # run the case it died on alone, to blame it and nothing else
                    pending += [[failed], rest]
                else:
                    rows.append({"model": failed[0], "seed": failed[1], "what": make_case(*failed)[1],
                                 "outcome": "crash", "code": proc.returncode, "stderr": stderr[-2000:]})
                    pending.append(rest)
    return rows


def cases_for(n: int, first_seed: int = 0, models: tuple[str, ...] = MODELS) -> list[tuple[str, int]]:
    return [(models[i % len(models)], first_seed + i) for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated fixtures to mutate")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker([tuple(c) for c in json.loads(args.worker[0])], Path(args.worker[1]))
        return
    t = time.perf_counter()
    models = tuple(args.models.split(","))
    if not set(models) <= set(MODELS):
        parser.error(f"--models: choose from {', '.join(MODELS)}")
    rows = run_cases(cases_for(args.cases, args.first_seed, models), args.workers)
    counts = Counter(row["outcome"] for row in rows)
    for row in rows:
        if row["outcome"] not in ("ran", "refused"):
            print(json.dumps(row))
    print(f"{len(rows)} cases in {time.perf_counter() - t:.1f} s: "
          + ", ".join(f"{counts[k]} {k}" for k in ("refused", "ran", "other", "crash")))
    sys.exit(0 if counts["other"] + counts["crash"] == 0 else 1)


if __name__ == "__main__":
    main()
