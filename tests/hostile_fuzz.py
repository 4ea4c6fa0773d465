"""A hostile-input fuzzer for the commands: seeded, generated bad inputs of every kind a user hands them,
each run as a subprocess with a timeout, its peak memory measured (os.wait4).

    python tests/hostile_fuzz.py --cases 600 --seed 1          # what `make fuzz-hostile` runs
    python tests/hostile_fuzz.py --kinds batch,config --cases 200 --show 20

The kinds: `batch` (model-generate --batch lines: wrong types, nulls, huge/NaN/1e999 numbers, deep
nesting, surrogates, BOMs, CRLF, non-UTF-8 bytes, duplicate keys), `config` (kv-memcalc --config
config.json fields and text_config), `memcalc` (kv-memcalc flags and sizes with odd units), `template`
(--chat-template files of model-generate --chat and model-chat), `snapshot` (kv-inspect FILE and
--load-cache FILE: truncated, wrong magic, wrong shapes, NaN rows, huge declared sizes), `flags`
(every numeric flag of every command, model names and file flags that are directories, FIFOs, devices,
loops of symlinks or huge files, odd standard input for model-chat) and `http` (a model-serve per case,
sent one to three hostile requests: wrong types, huge and deep bodies, odd paths, methods and headers).

A case is good when it exits 2 with one `PROG: error: ...` line on stderr and nothing else, or
exits 0 when its input may be valid. A bug: a traceback, any other exit code, a signal, a timeout, a
refusal of more than one line, exit 0 for input that must be refused, or a refusal that first took more
than 1 GB. An http case is good when every request gets an answer below 500 (or 503) and the server
stops cleanly on SIGTERM. A case is (kind, seed): the same pair always makes the same input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY = ROOT / "tests" / "fixtures" / "tiny_llama.gguf"  # context 256: any run it accepts ends quickly
REFUSED_MEMORY = 1 << 30  # bytes: the most a refused case may have used
TIMEOUT = 30.0
KINDS = ("batch", "config", "memcalc", "template", "snapshot", "flags", "http")


@dataclass
class Case:
    kind: str
    seed: int
    argv: list[str]
    what: str  # a short description of the input
    must_refuse: bool = False  # exit 0 is then a bug (input silently accepted or clipped)
    stdin: bytes = b""
    files: dict[str, bytes] = field(default_factory=dict)  # name in the case's directory -> content
    fifos: tuple[str, ...] = ()
    serve: bool = False  # model-serve: valid flags start a server, stopped once it listens


@dataclass
class Result:
    case: Case
    code: int | None
    stderr: str
    seconds: float
    peak_bytes: int
    verdict: str  # ok-refused, ok-ran, or a bug's name

    @property
    def bug(self) -> bool:
        return not self.verdict.startswith("ok")


# -- hostile values ---------------------------------------------------------------------------------


def deep(n: int, kind: str = "[") -> str:
    return "[" * n + "]" * n if kind == "[" else '{"a":' * n + "1" + "}" * n


JSON_VALUES = [  # JSON text of values of every wrong kind
    "null",
    "true",
    "false",
    '"3"',
    '""',
    "[]",
    "{}",
    "[1]",
    '["x"]',
    '{"a": 1}',
    "0",
    "-1",
    "1",
    "2",
    "-0",
    "0.5",
    "1.5",
    "-1.5",
    "1e-320",
    "1e999",
    "-1e999",
    "NaN",
    "Infinity",
    "-Infinity",
    "1e308",
    "4294967297",
    "9223372036854775808",
    "18446744073709551617",
    "100000000000000000000",
    "1" + "0" * 400,
    "9" * 5000,
    "16777216",
    "16777217",
    "1e6",
    "1.0",
    "2.0",
    "-2",
    '"\\ud800"',
    '"\\udfff x"',
    '"\\u0000"',
    '"a\\u0000b"',
    json.dumps("x" * 100_000),
    deep(5000),
    deep(200_000),
    deep(50_000, "{"),
    "[null]",
    '[""]',
    "[1, 2]",
    '["a", 1]',
    '"1e999"',
    '"NaN"',
    "255",
    "256",
    "257",
    "65536",
    "-2147483649",
]


def pick_json(rng: random.Random) -> str:
    return rng.choice(JSON_VALUES)


INTS = [
    "0",
    "-1",
    "-2",
    "1",
    "2",
    "3",
    "7",
    "255",
    "256",
    "257",
    "1000",
    "65535",
    "65536",
    "4096",
    "4097",
    "16777216",
    "16777217",
    "2147483647",
    "2147483648",
    "4294967296",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775809",
    "1" + "0" * 30,
    "9" * 400,
    "9" * 5000,
    "nan",
    "inf",
    "-inf",
    "1e9",
    "1e999",
    "1.5",
    "0x10",
    "0b1",
    "1_000",
    "+5",
    " 5",
    "5 ",
    "",
    "\u0661\u0662",
    "Ⅻ",
    "1k",
    "4k",
    "-0",
    "00",
    "0" * 100 + "1",
]
FLOATS = [
    "0",
    "-0",
    "0.0",
    "1",
    "-1",
    "0.5",
    "1.0",
    "1.0000001",
    "2",
    "1e-7",
    "1e-6",
    "1e-300",
    "5e-324",
    "1e308",
    "1.8e308",
    "1e999",
    "-1e999",
    "nan",
    "-nan",
    "NaN",
    "inf",
    "-inf",
    "Infinity",
    "1" * 400,
    "1e-999",
    "0x1p3",
    "",
    "1,5",
    "½",
    "1_0.5",
]
SIZES = [
    "1GiB",
    "1 GiB",
    "1gib",
    "1GB",
    "1gb",
    "1.5GiB",
    "0.5KiB",
    "0",
    "-1",
    "-1GiB",
    "1e3GB",
    "1e999GiB",
    "nanGiB",
    "infGiB",
    "NaN",
    "inf",
    "9" * 400 + "GiB",
    "9" * 5000,
    "1KB",
    "1kB",
    "1KiB",
    "1TiB",
    "1PiB",
    "1EiB",
    "1ZiB",
    "1YiB",
    "1ZB",
    "1QB",
    "1B",
    "1b",
    "1bit",
    "1 ",
    " 1",
    "GiB",
    "",
    "0x10GiB",
    "1_000MiB",
    "\u0661GiB",
    "1.GiB",
    ".5GiB",
    "1e-9GiB",
    "1e-300B",
    "2**40",
    "1GiBGiB",
    "1 G i B",
    "18446744073709551616",
    "1MiB",
    "1k",
    "1m",
    "1g",
    "1.5",
    "5e-324",
]
CONTEXTS = [
    "4096",
    "128k",
    "2k,4k",
    "0",
    "-1",
    "1",
    "k",
    "1.5k",
    "1e3",
    "nan",
    "1e999",
    "9" * 400,
    "2k,,4k",
    ",",
    "",
    "4K",
    "1m",
    "1M",
    "1g",
    "1G",
    "2**20",
    "0k",
    "-4k",
    "1" * 30,
    "4096,0",
    " 4k",
    "4k ",
    "\u0661\u0662\u0668k",
    "1000000000000k",
]
TEXTS = ["", " ", "\n", "x" * 100_000, "\udc80", "a\x01b", "\u202e", "\ufeff", "-", "--", "-n", "💥" * 1000]


def number_for(rng: random.Random, kind: str = "int") -> str:
    return rng.choice(INTS if kind == "int" else FLOATS)


# -- model-generate --batch lines -------------------------------------------------------------------

BATCH_KEYS = ["prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos"]


def _finite(value: float) -> bool:
    return isinstance(value, int) or math.isfinite(value)  # (an int of 400 digits is no float)


def _batch_value_ok(key: str, value: object) -> bool | None:
    """True: valid; False: must be refused; None: either."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if key == "prompt":
        return None if isinstance(value, str) else False
    if key == "max_new_tokens":
        if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value > 2**24:
            return False
        return None if value > 64 else True
    if key == "temperature":
        return number and _finite(value) and (value == 0 or value >= 1e-6)
    if key == "top_k":
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if key == "top_p":
        return number and _finite(value) and 0 < value <= 1
    if key == "seed":
        return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)
    if key == "stop":
        if isinstance(value, str):
            return None if value else False
        return (
            None
            if isinstance(value, list) and all(isinstance(s, str) and s for s in value)  # []: no stops
            else False
        )
    if key == "ignore_eos":
        return isinstance(value, bool)
    return False


def batch_case(rng: random.Random, seed: int) -> Case:
    entry = {"prompt": rng.choice(["hi", "Once upon a time", "a b c"])}
    for key in rng.sample(BATCH_KEYS[1:], rng.randint(0, 3)):
        entry[key] = {
            "max_new_tokens": 2,
            "temperature": 0.7,
            "top_k": 5,
            "top_p": 0.9,
            "seed": 1,
            "stop": ".",
            "ignore_eos": False,
        }[key]
    must_refuse = False
    maybe = False
    what = []
    mode = rng.random()
    body = json.dumps(entry)
    if mode < 0.55:  # one to three keys set to hostile values
        verdicts = {}  # by key: a key drawn twice is written once, with its last value
        hostile = {}
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            key = rng.choice([*BATCH_KEYS, "unknown", "Prompt", "", "\\ud800"])
            text = pick_json(rng)
            try:
                value = json.loads(text)
                verdict = _batch_value_ok(key, value) if key in BATCH_KEYS else False
            except (ValueError, RecursionError):
                verdict = False
            if key == "prompt" and text.startswith('"\\ud'):
                verdict = False
            if key == "max_new_tokens" and verdict and value > 200:
                verdict = None  # past the tiny model's context of 256: refused, or run to its end
            verdicts[key] = verdict
            what.append(f"{key}={text[:40]}")
            entry.pop(key, None)
            hostile[key] = text
        pairs = [json.dumps(entry)[1:-1], *(f'"{k}": {t}' for k, t in hostile.items())]
        body = "{" + ", ".join(p for p in pairs if p) + "}"
        must_refuse, maybe = False in verdicts.values(), None in verdicts.values()
    elif mode < 0.65:  # duplicate keys
        key = rng.choice(BATCH_KEYS)
        body = json.dumps(entry)[:-1] + f', "{key}": {pick_json(rng)}, "{key}": {pick_json(rng)}}}'
        what.append(f"duplicate {key}")
        maybe = True
    else:  # a line that is not an object with a prompt, or is text
        body = rng.choice(
            [
                "[]",
                "1",
                '"hi"',
                "null",
                "{",
                "{}",
                '{"prompt": "hi"',
                '{"prompt": "hi"} x',
                "{" * 100_000,
                deep(100_000, "{"),
                "   ",
                "\t",
                "plain prompt text",
                "{not json",
                "{'prompt': 'hi'}",
                '{"prompt": "hi"}\x00',
                "x" * 2_000_000,
                '{"prompt": "' + "y" * 3_000_000 + '"}',
                "\u2028",
                '{"prompt": "\\ud800"}',
                "\udc80 lone surrogate",
                "NaN",
                "{}" * 1000,
            ]
        )
        what.append(f"line {body[:30]!r}")
        maybe = True
    lines = [json.dumps({"prompt": "ok"})] * rng.randint(0, 2)
    lines.insert(rng.randint(0, len(lines)), body)
    data = "\n".join(lines).encode("utf-8", "surrogatepass")
    raw = rng.random()
    if raw < 0.1:
        data = b"\xef\xbb\xbf" + data
        what.append("BOM")
        maybe = True
    elif raw < 0.2:
        data = data.replace(b"\n", b"\r\n") + b"\r\n"
        what.append("CRLF")
    elif raw < 0.3:
        data = data + b"\n\n" + b"\n" * rng.randint(0, 3)
        what.append("empty lines")
        maybe = True
    elif raw < 0.38:
        at = rng.randint(0, len(data))
        data = data[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"]) + data[at:]
        what.append("non-UTF-8 byte")
        must_refuse, maybe = True, False
    elif raw < 0.42:
        data = b""
        what.append("empty file")
        must_refuse, maybe = True, False
    if maybe:
        must_refuse = False
    argv = [str(BIN / "model-generate"), str(TINY), "--batch", "batch.jsonl", "-n", "2"]
    return Case("batch", seed, argv, "; ".join(what), must_refuse, files={"batch.jsonl": data})


# -- kv-memcalc --config ----------------------------------------------------------------------------

LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
GEMMA3 = {
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "hidden_size": 640,
        "intermediate_size": 2048,
        "vocab_size": 262144,
        "sliding_window": 512,
        "max_position_embeddings": 32768,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    },
}
QWEN2 = {**LLAMA, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
MIXTRAL = {
    **LLAMA,
    "model_type": "mixtral",
    "num_local_experts": 8,
    "sliding_window": 4096,
    "quantization_config": {"quant_method": "awq", "bits": 4},
}
DEEPSEEK = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "hidden_size": 1024,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "q_lora_rank": 384,
    "vocab_size": 1000,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 16384,
    "quantization_config": {"quant_method": "fp8"},
}
CONFIG_BASES = [LLAMA, GEMMA3, QWEN2, MIXTRAL, DEEPSEEK]
CONFIG_KEYS = sorted(
    {k for base in CONFIG_BASES for k in base}
    | {k for k in GEMMA3["text_config"]}
    | {
        "head_dim",
        "sliding_window_pattern",
        "dtype",
        "n_routed_experts",
        "num_experts",
        "shared_expert_intermediate_size",
        "bits",
        "quant_method",
    }
)


def _set_path(config: dict, rng: random.Random, key: str, value: object) -> str:
    where = config
    if "text_config" in config and isinstance(config["text_config"], dict) and rng.random() < 0.6:
        where = config["text_config"]
    if key in ("bits", "quant_method"):
        where = config.setdefault("quantization_config", {})
        if not isinstance(where, dict):
            return key
    where[key] = value
    return key


def config_case(rng: random.Random, seed: int) -> Case:
    config = json.loads(json.dumps(rng.choice(CONFIG_BASES)))
    what = []
    text = None
    for _ in range(rng.randint(1, 3)):
        mode = rng.random()
        if mode < 0.55:
            key = rng.choice(CONFIG_KEYS)
            raw = pick_json(rng)
            try:
                value = json.loads(raw)
            except (ValueError, RecursionError):
                continue
            what.append(f"{_set_path(config, rng, key, value)}={raw[:30]}")
        elif mode < 0.65:
            key = rng.choice(CONFIG_KEYS)
            for where in (config, config.get("text_config")):
                if isinstance(where, dict):
                    where.pop(key, None)
            what.append(f"no {key}")
        elif mode < 0.75:
            config["text_config"] = json.loads(
                rng.choice(
                    [
                        "null",
                        "[]",
                        '"x"',
                        "1",
                        "{}",
                        '{"text_config": {}}',
                        '{"num_hidden_layers": 0}',
                        deep(100),
                    ]
                )
            )
            what.append("text_config variant")
        elif mode < 0.85:
            key = rng.choice(["num_key_value_heads", "layer_types", "num_attention_heads", "head_dim"])
            layers = config.get("num_hidden_layers", 4)
            n = layers + rng.choice([-1, 0, 1]) if isinstance(layers, int) and layers < 1000 else 3
            item = rng.choice(["2", "0", "-1", "null", '"x"', "true", "2.0", "1e999", "[2]"])
            value = json.loads("[" + ",".join([item] * max(n, 0)) + "]")
            _set_path(config, rng, key, value)
            what.append(f"{key}=[{item} x {n}]")
        else:
            heads = rng.choice([0, -8, 3, 7, 1, 2**40, 10**20])
            _set_path(config, rng, "num_attention_heads", heads)
            config.pop("head_dim", None)
            what.append(f"heads={heads} hidden not divisible")
    try:
        text = json.dumps(config, allow_nan=True)
    except (ValueError, RecursionError):
        text = "{}"
    data = text.encode("utf-8", "surrogatepass")
    raw = rng.random()
    if raw < 0.08:
        data = b"\xef\xbb\xbf" + data
        what.append("BOM")
    elif raw < 0.14:
        data = data[: rng.randint(0, len(data))]
        what.append("truncated")
    elif raw < 0.18:
        data = data.replace(b"4096", b"\xff", 1)
        what.append("non-UTF-8")
    elif raw < 0.22:
        data = rng.choice([b"", b"null", b"[]", b"1e999", b'"x"', deep(300_000).encode(), b"\x00" * 100])
        what = [f"whole file {data[:20]!r}"]
    argv = [str(BIN / "kv-memcalc"), "--config", "config.json", *memcalc_flags(rng, 0.4)]
    return Case("config", seed, argv, "; ".join(what), files={"config.json": data})


MEMCALC_FLAGS = {
    "--layers": INTS,
    "--kv-heads": INTS,
    "--head-dim": INTS,
    "--heads": INTS,
    "--batch": INTS,
    "--context": CONTEXTS,
    "--budget": SIZES,
    "--gpus": [
        "4x80GiB",
        "0x80GiB",
        "-1x80GiB",
        "4x",
        "x80GiB",
        "4x80",
        "4X80GiB",
        "1e999x80GiB",
        "9" * 400 + "x1GiB",
        "4x80GiBx2",
        "4x-1GiB",
        "4x0",
        "nanx1GiB",
        "1000000x80GiB",
        "4 x 80GiB",
        "4x1e999GiB",
    ],
    "--gpu-memory": SIZES,
    "--tp": INTS,
    "--pp": INTS,
    "--gpu-memory-utilization": FLOATS,
    "--block-size": INTS,
    "--overhead": SIZES,
    "--weights": SIZES,
    "--sliding-window": INTS,
    "--sliding-layers": [
        "all",
        "0-4",
        "0-4,6-10",
        "4-0",
        "-1",
        "0--1",
        "a",
        "",
        ",",
        "0-99999999999",
        "0-" + "9" * 400,
        "1,1,1",
        "none",
        "0-4,,5",
        "999",
    ],
    "--sliding-pattern": INTS,
    "--dtype": ["f16", "F16", "q8_0", "q4_0", "fp8", "x", ""],
    "--kv": ["prealloc", "paged", "window", "zzz", ""],
    "--kv-dtype": ["f32", "q8_0", "zzz", ""],
    "--weight-dtype": ["bf16", "fp8", "int4", "zzz"],
}


def memcalc_flags(rng: random.Random, p: float) -> list[str]:
    args = []
    for flag in rng.sample(sorted(MEMCALC_FLAGS), rng.randint(0, 4) if rng.random() < p else 0):
        args += [flag, rng.choice(MEMCALC_FLAGS[flag])]
    if rng.random() < 0.3:
        args.append("--json")
    return args


KV_DTYPES = ["f32", "f16", "q8_0", "q8_0h", "q4_0", "q4_0h", "q4_kivi", "q4_recent", "bf16", "fp8", "x", ""]


def memcalc_case(rng: random.Random, seed: int) -> Case:
    args = ["--layers", rng.choice(["2", "32", "80"]), "--kv-heads", rng.choice(["1", "8"])]
    if rng.random() < 0.3:  # from a model's metadata, with inferno's own caches sized (--kv, --kv-dtype)
        args = [
            "--model",
            str(TINY),
            "--kv",
            rng.choice([*MEMCALC_FLAGS["--kv"], "basic"]),
            "--kv-dtype",
            rng.choice(KV_DTYPES),
        ]
    for flag in rng.sample(sorted(MEMCALC_FLAGS), rng.randint(1, 5)):
        args += [flag, rng.choice(MEMCALC_FLAGS[flag])]
    if rng.random() < 0.3:
        args.append("--json")
    return Case("memcalc", seed, [str(BIN / "kv-memcalc"), *args], " ".join(args[4:])[:80])


# -- chat templates ---------------------------------------------------------------------------------

TEMPLATE_PIECES = [
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    "{{ bos_token }}",
    "{{ eos_token }}",
    "{% if add_generation_prompt %}assistant:{% endif %}",
    "{{ undefined_variable }}",
    "{{ foo.bar }}",
    "{{ foo() }}",
    "{{ none.attr }}",
    "{{ messages[0].content.nope.deeper }}",
    "{{ messages[99] }}",
    "{{ messages[0]['x']['y'] }}",
    "{{ raise_exception('refused by template') }}",
    "{{ raise_exception() }}",
    "{{ raise_exception(none) }}",
    "{{ raise_exception('x' * 100000) }}",
    "{% for %}",
    "{% if %}",
    "{{",
    "}}",
    "{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% for i in range(10**8) %}{% endfor %}",
    "{% for i in range(100000) %}{{ i }}{% endfor %}",
    "{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 10**7 }}",
    "{{ [1] * 10**8 }}",
    "{{ 9 ** 9 ** 9 }}",
    "{{ 2 ** -1 }}",
    "{{ (-2) ** 0.5 }}",
    "{{ 1 / 0 }}",
    "{{ 1 % 0 }}",
    "{{ 'a' % () }}",
    "{{ '%s' % 'x' * 5 }}",
    "{{ '%(a)s' % {} }}",
    "{{ messages | tojson(indent=100000) }}",
    "{{ messages | tojson }}",
    "{{ 'x' | indent(10**9) }}",
    "{{ 'x' | wordwrap(10**9) }}",
    "{{ 'x' | truncate(-1) }}",
    "{{ 'abc' | batch(0) | list }}",
    "{{ range(10) | slice(0) | list }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ 'x'.zfill(10**9) }}",
    "{{ '\\t'.expandtabs(10**9) }}",
    "{{ 'ab'.split('') }}",
    "{{ 'x'.encode() }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ lipsum(10**6) }}",
    "{{ lipsum(100, html=false, min=10**6) }}",
    "{{ range(10**6) | list | length }}",
    "{{ range(10**7) | sum }}",
    "{{ range(10**5) | join(',') }}",
    "{% set x = namespace(v=[]) %}{% for i in range(10**6) %}{% set _ = x.v.append(i) %}{% endfor %}",
    "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
    "{{ strftime_now('%Y' * 10**6) }}",
    "{{ strftime_now(none) }}",
    "{{ '\\ud800' }}",
    "{{ '\\x00' }}",
    "{{ messages[0].content | int }}",
    "{{ 'x' | float }}",
    "{{ 10**400 | float }}",
    "{{ 1e308 * 10 }}",
    "{{ (10 ** 5000) | string }}",
    "{% include 'x' %}",
    "{% extends 'x' %}",
    "{% import 'x' as y %}",
    "{% generation %}x{% endgeneration %}",
    "{% break %}",
    "{% for i in range(3) %}{% continue %}{% endfor %}",
    "{% raw %}{{ x }}{% endraw %}",
    "{# unclosed comment",
    "{% set x = x %}",
    "{{ self }}",
    "{{ self.__dict__ }}",
    "{{ loop }}",
    "{{ messages.append(1) }}",
    "{{ messages.pop() }}",
    "{{ {}.update(a=1) }}",
    "{{ 'abc'[10**20] }}",
    "{{ 'abc'[::0] }}",
    "{{ x | default('d') }}",
    "{{ 'ab' | replace('', 'x' * 10**6) }}",
    "{{ 'x' ~ ('y' * 10**6) ~ ('z' * 10**6) }}",
    "{{ '%.1000000f' % 1.0 }}",
    "{{ '%*d' % (10**9, 1) }}",
    "{{ '{}'.format(1) }}",
    "{{ 'x' | center(-5) }}",
    "{{ tools | tojson }}",
    "{{ 1 | tojson(indent=-1) }}",
    "{{ 'a' | tojson(sort_keys=1, indent='\\t' * 10**6) }}",
    "{{ messages | map(attribute='x') | list }}",
    "{{ messages | selectattr('role', 'nonexistent_test') | list }}",
    "{{ messages | sort(attribute='x.y') }}",
    "{{ messages | groupby('zz') | list }}",
    "{{ 'x' | attr('__class__') }}",
    "{{ [] | first }}",
    "{{ [] | random }}",
    "{{ 0 | filesizeformat }}",
    "{{ 10**400 | filesizeformat }}",
    "{{ 10**400 | round }}",
    "{{ 1e999 }}",
    "{{ 1e308 | round(10**6) }}",
    "{{ 'x' | round }}",
    "{{ [3, 1] | max(attribute='x') }}",
]


def template_case(rng: random.Random, seed: int) -> Case:
    pieces = rng.sample(TEMPLATE_PIECES, rng.randint(1, 3))
    if rng.random() < 0.5:
        pieces.insert(0, TEMPLATE_PIECES[0])
    data = "".join(pieces).encode("utf-8", "surrogatepass")
    what = " | ".join(p[:40] for p in pieces)
    raw = rng.random()
    if raw < 0.06:
        data = b"\xff\xfe" + data
        what += " (non-UTF-8)"
    elif raw < 0.1:
        data = b""
        what = "empty file"
    elif raw < 0.13:
        data = b"x" * (1 << 20) + b"y"
        what = "over 1 MiB"
    elif raw < 0.16:
        data = b"\xef\xbb\xbf" + data
        what += " (BOM)"
    if rng.random() < 0.3:
        argv = [str(BIN / "model-chat"), str(TINY), "--chat-template", "t.jinja", "-n", "2"]
        stdin = rng.choice([b"hi\n", b"", b"hi\n/stats\nagain\n", b"\xff\xfe\n"])
    else:
        argv = [str(BIN / "model-generate"), "--chat", "--chat-template", "t.jinja", str(TINY), "hi", "2"]
        if rng.random() < 0.3:
            argv[2:2] = ["--system", rng.choice(["be brief", "", "\udc80"])]
        stdin = b""
    return Case("template", seed, argv, what, files={"t.jinja": data}, stdin=stdin)


# -- snapshots --------------------------------------------------------------------------------------

_SNAPSHOT: bytes | None = None


def good_snapshot() -> bytes:
    """A snapshot of the tiny model (made once per run with model-generate --save-cache)."""
    global _SNAPSHOT
    if _SNAPSHOT is None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "good.st"
            subprocess.run(
                [
                    str(BIN / "model-generate"),
                    "--threads",
                    "1",
                    "--kv",
                    "prealloc",
                    "--save-cache",
                    str(path),
                    str(TINY),
                    "hello world",
                    "4",
                ],
                capture_output=True,
                check=True,
                timeout=120,
            )
            _SNAPSHOT = path.read_bytes()
    return _SNAPSHOT


def _split(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: dict, body: bytes, pad: bool = True) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode("utf-8", "surrogatepass")
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def snapshot_case(rng: random.Random, seed: int) -> Case:
    data = good_snapshot()
    header, body = _split(data)
    what = []
    mode = rng.random()
    if mode < 0.12:
        cut = rng.choice([0, 4, 7, 8, 9, 50, len(data) // 2, len(data) - 1, rng.randint(0, len(data))])
        data = data[:cut]
        what.append(f"cut at {cut}")
    elif mode < 0.2:
        data = rng.choice(
            [
                struct.pack("<Q", 2**63) + data[8:],
                struct.pack("<Q", 2**40) + data[8:],
                struct.pack("<Q", len(data)) + data[8:],
                b"GGUF" + data[4:],
                b"\x00" * 8 + data[8:],
                b"PK\x03\x04" + data,
                b"{" * 1000,
            ]
        )
        what.append(f"header length/magic {data[:8].hex()}")
    elif mode < 0.3:
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(8, min(len(data), 8 + len(json.dumps(header))))
            data = data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :]
        what.append("header bytes flipped")
    elif mode < 0.75:
        name = rng.choice(["keys", "values", "token_ids", "__metadata__"])
        if name == "__metadata__":
            meta = header["__metadata__"]
            key = rng.choice([*meta, "windows", "kv_dtype", "x"])
            value = rng.choice(
                [
                    "0",
                    "-1",
                    "1",
                    "3",
                    "99999999999999999999",
                    "1e999",
                    "nan",
                    "",
                    "x",
                    "\ud800",
                    "q8_0",
                    "q4_0",
                    "bf16",
                    "fp8",
                    "f16",
                    "q4_recent",
                    "global",
                    "8,global",
                    "0,0",
                    "-5",
                    str(2**31),
                    "1" * 5000,
                    "2",
                ]
            )
            if rng.random() < 0.15:
                meta.pop(key, None)
                what.append(f"no metadata {key}")
            else:
                meta[key] = value
                what.append(f"metadata {key}={value[:20]!r}")
            if rng.random() < 0.2:
                header["__metadata__"] = rng.choice([None, [], "x", {"a": 1}])
                what.append("metadata replaced")
        else:
            tensor = header[name]
            field_name = rng.choice(["shape", "dtype", "data_offsets"])
            if field_name == "shape":
                shape = list(tensor["shape"])
                choice = rng.random()
                if choice < 0.4 and shape:
                    shape[rng.randrange(len(shape))] = rng.choice([0, 1, 2, 10**9, 2**40, 2**62, -1])
                elif choice < 0.7:
                    shape = rng.choice([[], [1], [*shape, 1], shape[:-1], [10**6, 10**6, 10**6]])
                else:
                    shape = list(reversed(shape))
                tensor["shape"] = shape
                what.append(f"{name} shape {shape}")
            elif field_name == "dtype":
                tensor["dtype"] = rng.choice(
                    ["F64", "F16", "BF16", "I64", "U8", "I32", "F32", "BOOL", "X", "F8_E4M3"]
                )
                what.append(f"{name} dtype {tensor['dtype']}")
            else:
                a, b = tensor["data_offsets"]
                tensor["data_offsets"] = rng.choice(
                    [[b, a], [a, b + 4], [0, 2**40], [a, a], [-1, b], [a, 2**64 - 1], [0, 0]]
                )
                what.append(f"{name} offsets {tensor['data_offsets']}")
        data = _join(header, body)
    elif mode < 0.9:  # NaN / Inf rows (the checksum fixed up, or not)
        import numpy as np

        keys = header["keys"]
        start, end = keys["data_offsets"]
        rows = np.frombuffer(body[start:end], np.float32).copy()
        rows[rng.randrange(len(rows))] = rng.choice([np.nan, np.inf, -np.inf, 3e38])
        body = body[:start] + rows.tobytes() + body[end:]
        if rng.random() < 0.8:
            import hashlib

            digest = hashlib.sha256()
            for name in ("keys", "values", "token_ids"):
                s, e = header[name]["data_offsets"]
                digest.update(body[s:e])
            header["__metadata__"]["data_sha256"] = digest.hexdigest()
            what.append("non-finite row, checksum fixed")
        else:
            what.append("non-finite row")
        data = _join(header, body)
    else:
        data = rng.choice(
            [
                b"",
                b"\x00",
                b"not a snapshot",
                b"\xff" * 64,
                _join({"__metadata__": {}}, b""),
                _join({}, b""),
                _join(
                    {"keys": {"dtype": "F32", "shape": [2**62, 2**62, 2**62], "data_offsets": [0, 0]}}, b""
                ),
                _join({"__metadata__": None}, b""),
            ]
        )
        what.append(f"whole file {data[:16]!r}")
    if rng.random() < 0.5:
        argv = [str(BIN / "kv-inspect"), "snap.safetensors"]
    else:
        argv = [
            str(BIN / "model-generate"),
            "--load-cache",
            "snap.safetensors",
            str(TINY),
            "hello world again",
            "2",
        ]
    return Case("snapshot", seed, argv, "; ".join(what)[:100], files={"snap.safetensors": data})


# -- flags of every command -------------------------------------------------------------------------

COMMANDS = {
    "model-generate": {
        "base": [str(TINY), "hi", "2"],
        "int": [
            "-n",
            "--max-context",
            "--block-size",
            "--num-samples",
            "--max-batch",
            "--window",
            "--sinks",
            "--top-k",
            "--seed",
            "--threads",
            "--log-tokens",
        ],
        "float": ["--temperature", "--top-p"],
        "text": ["--kv", "--kv-dtype", "--stop", "--system", "--activations"],
    },
    "model-chat": {
        "base": [str(TINY)],
        "int": ["-n", "--max-context", "--top-k", "--seed", "--threads"],
        "float": ["--temperature", "--top-p"],
        "text": ["--kv", "--kv-dtype", "--system"],
    },
    "kv-inspect": {
        "base": [str(TINY), "hi"],
        "int": [
            "--decode",
            "--layer",
            "--max-context",
            "--window",
            "--sinks",
            "--block-size",
            "--num-samples",
            "--threads",
        ],
        "float": [],
        "text": ["--kv", "--kv-dtype"],
    },
    "kv-bench": {
        "base": [str(TINY), "-n", "2", "--rounds", "1", "--modes", "prealloc"],
        "int": ["--depth", "-n", "--tokens", "--average", "--block-size", "--rounds"],
        "float": [],
        "text": ["--batch-sweep", "--step-tokens", "--mixed-load", "--modes", "--kv-dtype"],
    },
    "kv-perplexity": {
        "base": [str(TINY), "--text", "text.txt", "--window", "16"],
        "int": ["--window", "--sinks"],
        "float": [],
        "text": [],
    },
    "model-serve": {
        "base": [str(TINY), "--port", "0"],
        "int": ["--port", "--block-size", "--max-batch", "--step-tokens", "--max-waiting", "--threads"],
        "float": [],
        "text": ["--cache-memory", "--kv", "--kv-dtype", "--host", "--api-key"],
    },
}
LISTS = [
    "1,2",
    "0",
    "-1",
    "1,,2",
    "",
    ",",
    "1e999",
    "9" * 400,
    "nan",
    "1,100000",
    "100000",
    "off",
    "64,off",
    "2,x",
    "1" * 30,
    "4096,4096,4096",
    "prealloc,paged",
    "zzz",
    "window",
    "q8_0,q4_0",
]
MODEL_PATHS = [
    "dir",
    "fifo",
    "/dev/null",
    "/dev/zero",
    "/dev/urandom",
    "/dev/full",
    "/proc/self/status",
    "empty.gguf",
    "missing.gguf",
    "loop.gguf",
    "/",
    ".",
    "-",
    "\udc80.gguf",
    "x" * 5000 + ".gguf",
    "truncated.gguf",
    "text.gguf",
    "smollm2",
    "gemma3",
]


FILE_FLAGS = {
    "model-generate": ["--prompt-file", "--batch", "--chat-template", "--load-cache", "--save-cache"],
    "model-chat": ["--chat-template"],
    "kv-inspect": ["--plot"],
    "kv-bench": ["--text-file", "--plot"],
    "kv-perplexity": ["--text"],
    "model-serve": ["--chat-template"],
}
HOSTILE_CONTENT = {
    "huge.txt": lambda: b"hello world " * (16 * 2**20 // 12 - 1),  # just under --prompt-file's 16 MiB
    "nospace.txt": lambda: b"x" * 3_000_000,
    "latin1.txt": lambda: b"caf\xe9 " * 100,
    "empty.txt": lambda: b"",
    "nul.txt": lambda: b"\x00" * 100_000,
    "bom.txt": lambda: b"\xef\xbb\xbfhello",
    "u2028.txt": lambda: '{"prompt": "a\u2028b"}\n'.encode(),
    "lines.txt": lambda: b"hi\n" * 5000,
}
HOSTILE_FILES = [
    "fifo.in",
    "dir.in",
    "/dev/zero",
    "/dev/null",
    "/dev/full",
    "/dev/urandom",
    "missing.txt",
    "/proc/self/status",
    "/",
    *HOSTILE_CONTENT,
]


def flags_case(rng: random.Random, seed: int) -> Case:
    name = rng.choice(sorted(COMMANDS))
    spec = COMMANDS[name]
    argv = [str(BIN / name), *spec["base"]]
    what = []
    files = {"text.txt": b"Once upon a time there was a tiny model. " * 20}
    fifos: tuple[str, ...] = ()
    if rng.random() < 0.2:  # the model argument is not a model file
        model = rng.choice(MODEL_PATHS)
        if model == "dir":
            files["dir/x"] = b""
        elif model == "fifo":
            fifos = ("fifo",)
        elif model == "empty.gguf":
            files[model] = b""
        elif model == "truncated.gguf":
            files[model] = TINY.read_bytes()[:1000]
        elif model == "text.gguf":
            files[model] = b"hello\n"
        argv[1] = model
        what.append(f"model {model[:30]!r}")
    if name in ("model-generate", "kv-inspect") and rng.random() < 0.5:  # a cache kind its flags go with
        argv += ["--kv", rng.choice(["window", "paged", "prealloc", "basic", "pages", "zzz"])]
        if rng.random() < 0.5:
            argv += ["--kv-dtype", rng.choice(KV_DTYPES)]
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice([k for k in ("int", "float", "text") if spec[k]])
        flag = rng.choice(spec[kind])
        value = (
            number_for(rng, kind)
            if kind != "text"
            else rng.choice(LISTS + TEXTS + SIZES if flag not in ("--stop", "--system") else TEXTS)
        )
        if flag in ("--batch-sweep", "--step-tokens", "--mixed-load"):
            value = rng.choice(LISTS)
        argv += [flag if not flag.startswith("--log") else f"{flag}={value}"] + (
            [] if flag.startswith("--log") else [value]
        )
        what.append(f"{flag} {value[:20]!r}")
    if rng.random() < 0.35 and FILE_FLAGS.get(name):  # a file flag naming what is not a usable file
        flag = rng.choice(FILE_FLAGS[name])
        target = rng.choice(HOSTILE_FILES)
        if target == "fifo.in":
            fifos = (*fifos, "fifo.in")
        elif target == "dir.in":
            files["dir.in/x"] = b""
        elif target in HOSTILE_CONTENT:
            files[target] = HOSTILE_CONTENT[target]()
        extra = ["--kv", "prealloc"] if flag in ("--load-cache", "--save-cache") else []
        extra += ["--chat"] if flag == "--chat-template" and name == "model-generate" else []
        argv += [*extra, flag, target]
        if flag in ("--prompt-file", "--batch") and len(argv) > 3 and argv[2] == "hi":
            del argv[2]  # the prompt comes from the file
        what.append(f"{flag} {target}")
    stdin = b"hi\n" if name == "model-chat" else b""
    if name == "model-chat" and rng.random() < 0.3:
        stdin = rng.choice(
            [
                b"x" * 20_000_000 + b"\n",
                b"\xff\xfe\n",
                b"/save\n",
                b"/save /dev/full\n",
                b"/save dir.in\n",
                b"/save fifo.in\n",
                b"\x00" * 1000 + b"\n",
                b"hi " * 3000 + b"\n",
                b"/reset\n/stats\n" * 50,
            ]
        )
        what.append(f"stdin {stdin[:20]!r}")
    return Case(
        "flags",
        seed,
        argv,
        "; ".join(what),
        files=files,
        fifos=fifos,
        stdin=stdin,
        serve=name == "model-serve",
    )


# -- model-serve's HTTP requests --------------------------------------------------------------------

COMPLETION = {"model": "tiny_llama", "prompt": "Once upon a time", "max_tokens": 2}
CHAT = {"model": "tiny_llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HTTP_KEYS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "seed",
    "echo",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "response_format",
    "tools",
    "suffix",
    "best_of",
    "unknown",
]
MESSAGES = ['[]', '[{}]', '[{"role": "user"}]', '[{"role": "user", "content": null}]',
            '[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]',
            '[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]',
            '[{"role": "system", "content": "s"}]', '[{"role": "bogus", "content": "hi"}]',
            '[{"role": "user", "content": 1}]', '[{"role": "user", "content": "\\ud800"}]',
            '[{"role": "user", "content": "hi", "name": ' + json.dumps("n" * 1000) + '}]', '"hi"', "null",
            '[{"role": "user", "content": ' + json.dumps("x" * 3_000_000) + "}]"]  # fmt: skip


def http_case(rng: random.Random, seed: int) -> Case:
    """One model-serve process, sent one to three hostile requests (see run_http)."""
    requests = []
    for _ in range(rng.randint(1, 3)):
        chat = rng.random() < 0.45
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = dict(CHAT if chat else COMPLETION)
        mode = rng.random()
        if mode < 0.6:
            raw_values = {}
            for _ in range(rng.randint(1, 3)):
                key = rng.choice(HTTP_KEYS)
                raw_values[key] = (
                    rng.choice(MESSAGES) if key == "messages" and rng.random() < 0.6 else pick_json(rng)
                )
                body.pop(key, None)
            pairs = [json.dumps(body)[1:-1], *(f'"{k}": {v}' for k, v in raw_values.items())]
            data = ("{" + ", ".join(p for p in pairs if p) + "}").encode("utf-8", "surrogatepass")
            what = ",".join(f"{k}={v[:15]}" for k, v in raw_values.items())
        else:
            data = rng.choice(
                [
                    b"",
                    b"{",
                    b"[]",
                    b"null",
                    b'"x"',
                    b"\xff\xfe",
                    deep(100_000).encode(),
                    b"\xef\xbb\xbf" + json.dumps(body).encode(),
                    json.dumps(body).encode() * 2,
                    b'{"prompt": "' + b"y" * 20_000_000 + b'", "model": "tiny_llama"}',
                    json.dumps({**body, "stream": True}).encode(),
                ]
            )
            what = f"raw {data[:15]!r}"
        method = rng.choice(["POST"] * 8 + ["GET", "PUT"])
        if rng.random() < 0.1:
            path = rng.choice(
                [
                    "/v1/models",
                    "/health",
                    "/metrics",
                    "/v1/models/x",
                    "/v1//completions",
                    "/v1/completions?x=%ff",
                    "/" + "a" * 10000,
                ]
            )
        headers = {
            "Content-Type": rng.choice(["application/json"] * 6 + ["text/plain", "", "x/x; charset=zz"])
        }
        if rng.random() < 0.1:
            headers["Authorization"] = rng.choice(["Bearer", "Bearer x", "Basic \xff", "x" * 8000])
        requests.append({"method": method, "path": path, "body": data, "headers": headers, "what": what})
    argv = [str(BIN / "model-serve"), str(TINY), "--port", "0", "--threads", "1"]
    return Case(
        "http",
        seed,
        argv,
        " | ".join(f"{r['method']} {r['path'][:25]} {r['what']}" for r in requests),
        serve=True,
        files={
            "requests.json": json.dumps(
                [{**r, "body": r["body"].decode("latin-1")} for r in requests]
            ).encode()
        },
    )


def run_http(case: Case, timeout: float = TIMEOUT) -> Result:
    """Start the server, send the case's requests, stop it with SIGTERM: a 5xx other than 503, a request
    that fails or hangs, a traceback, or a server that dies or does not stop cleanly is a bug."""
    import http.client

    requests = json.loads(case.files["requests.json"])
    t0 = time.monotonic()
    proc = subprocess.Popen(
        case.argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, "NO_COLOR": "1"},
    )
    err, _, listening = _read_stderr(proc, timeout, True)
    verdict = None
    if not listening:
        verdict = "server did not start"
    else:
        port = int(err.decode().split("listening on http://127.0.0.1:")[1].split()[0])
        for r in requests:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
                conn.request(
                    r["method"],
                    r["path"],
                    body=r["body"].encode("latin-1"),
                    headers={k: v for k, v in r["headers"].items() if v},
                )
                status = conn.getresponse().status
                conn.close()
            except (OSError, http.client.HTTPException) as exc:
                verdict = f"request failed ({type(exc).__name__})"
                break
            if status >= 500 and status != 503:
                verdict = f"http {status}"
                break
        if proc.poll() is not None and verdict is None:
            verdict = "server died"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        _, status, usage = _wait4(proc.pid, timeout)
    except TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        _, status, usage = os.wait4(proc.pid, 0)
        verdict = verdict or "did not stop on SIGTERM"
    err += proc.stderr.read()
    proc.stderr.close()
    text = err.decode("utf-8", "replace")
    code = os.waitstatus_to_exitcode(status)
    if verdict is None and ("Traceback" in text or "Exception in ASGI" in text):
        verdict = "traceback"
    if verdict is None and code not in (0, -signal.SIGTERM):
        verdict = f"exit {code}"
    peak = usage.ru_maxrss * 1024
    if verdict is None and peak > REFUSED_MEMORY:
        verdict = "server over 1 GB"
    return Result(case, code, text, time.monotonic() - t0, peak, verdict or "ok-served")


def _wait4(pid: int, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = os.wait4(pid, os.WNOHANG)
        if done[0]:
            return done
        time.sleep(0.05)
    raise TimeoutError


GENERATORS = {
    "batch": batch_case,
    "config": config_case,
    "memcalc": memcalc_case,
    "template": template_case,
    "snapshot": snapshot_case,
    "flags": flags_case,
    "http": http_case,
}


def make_case(kind: str, seed: int) -> Case:
    return GENERATORS[kind](random.Random(f"{kind}:{seed}"), seed)


# -- running a case ---------------------------------------------------------------------------------


def run_pair(kind: str, seed: int, timeout: float = TIMEOUT) -> Result:
    """The case made, run and let go of: the fuzzer stays small, and so does what a child's peak RSS
    counts of it (Linux's ru_maxrss keeps the high-water mark of the memory a child had before exec, a
    copy of ours)."""
    try:
        case = make_case(kind, seed)
    except Exception as exc:  # the fuzzer's own bug: reported as one, the run goes on
        return Result(Case(kind, seed, ["(none)"], f"making the case: {exc!r}"[:200]), None, "", 0.0, 0,
                      "fuzzer error")
    result = run_case(case, timeout)
    result.case.files, result.case.stdin = {}, b""
    return result


def run_case(case: Case, timeout: float = TIMEOUT) -> Result:
    if case.kind == "http":
        return run_http(case, timeout)
    with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
        for name, data in case.files.items():
            path = Path(tmp) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        for name in case.fifos:
            os.mkfifo(Path(tmp) / name)
        with_loop = Path(tmp) / "loop.gguf"
        with_loop.symlink_to(with_loop)
        env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "100", "PYTHONFAULTHANDLER": "1"}
        argv = [a.encode("utf-8", "surrogateescape") if isinstance(a, str) else a for a in case.argv]
        t0 = time.monotonic()
        stdin = Path(tmp) / ".stdin"  # a file, not a pipe: a command that never reads it cannot block us
        stdin.write_bytes(case.stdin)
        with stdin.open("rb") as given:
            proc = subprocess.Popen(
                argv,
                cwd=tmp,
                stdin=given,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        err, timed_out, listening = _read_stderr(proc, timeout, case.serve)
        if timed_out or listening:
            os.killpg(proc.pid, signal.SIGKILL if timed_out else signal.SIGTERM)
        _, status, usage = os.wait4(proc.pid, 0)
        err += proc.stderr.read()
        proc.stderr.close()
        seconds = time.monotonic() - t0
    code = os.waitstatus_to_exitcode(status)
    text = err.decode("utf-8", "replace")
    peak = usage.ru_maxrss * 1024
    return Result(case, code, text, seconds, peak, classify(case, code, text, peak, timed_out, listening))


def _read_stderr(proc: subprocess.Popen, timeout: float, serve: bool) -> tuple[bytes, bool, bool]:
    """stderr until the process ends (or, serving, says it listens); whether it ran out of time."""
    out = b""
    deadline = time.monotonic() + timeout
    fd = proc.stderr.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return out, True, False
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return out, False, False
            out += chunk
            if serve and b"listening on" in out:
                return out, False, True
            if len(out) > 1 << 20:
                return out, True, False


def classify(case: Case, code: int, err: str, peak: int, timed_out: bool, listening: bool) -> str:
    if timed_out:
        return "timeout"
    if "Traceback" in err or "Fatal Python error" in err:
        return "traceback"
    if listening:
        return "ok-ran"
    if code == 0:
        return "accepted-bad-input" if case.must_refuse else "ok-ran"
    if code < 0:
        return f"signal {-code}"
    if code != 2:
        return f"exit {code}"
    prog = Path(case.argv[0]).name
    lines = err.strip().splitlines()  # a note held from the start-up is dropped by a refusal too
    if prog == "model-chat":  # a turn's refusal is one line and the session goes on: the last line decides
        lines = lines[-1:]
    if len(lines) != 1 or not lines[0].startswith(f"{prog}: "):
        return "not one line"
    if peak > REFUSED_MEMORY:
        return "refused after >1 GB"
    return "ok-refused"


# -- the command line -------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=int, default=600, help="cases in all, spread over the kinds")
    parser.add_argument("--seed", type=int, default=0, help="first seed of each kind")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated: {', '.join(KINDS)}")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=TIMEOUT)
    parser.add_argument("--show", type=int, default=50, help="bugs to print in full")
    parser.add_argument("--json", dest="as_json", metavar="FILE", help="write every result to FILE")
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {', '.join(sorted(unknown))}")
    if "snapshot" in kinds:
        good_snapshot()
    pairs = [(kinds[i % len(kinds)], args.seed + i // len(kinds)) for i in range(args.cases)]
    results: list[Result] = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(args.workers) as pool:
        for result in pool.map(lambda pair: run_pair(*pair, args.timeout), pairs):
            results.append(result)
            if result.bug:
                last = result.stderr.strip().splitlines()[-1:] or [""]
                print(
                    f"BUG {result.verdict}: {result.case.kind} seed {result.case.seed}: {result.case.what}"
                    f" -> {last[0][:200]}",
                    flush=True,
                )
    by_kind = Counter((r.case.kind, r.verdict) for r in results)
    print(f"\n{len(results)} cases in {time.monotonic() - t0:.0f} s")
    for kind in kinds:
        counts = {v: n for (k, v), n in by_kind.items() if k == kind}
        print(
            f"  {kind:9} {sum(counts.values()):5}  "
            + ", ".join(f"{v} {n}" for v, n in sorted(counts.items()))
        )
    peak = max((r.peak_bytes for r in results if r.verdict == "ok-refused"), default=0)
    print(f"  largest peak RSS of a refused case: {peak / 2**20:.0f} MiB")
    if args.as_json:
        Path(args.as_json).write_text(
            json.dumps(
                [
                    {
                        "kind": r.case.kind,
                        "seed": r.case.seed,
                        "what": r.case.what,
                        "argv": r.case.argv[1:],
                        "code": r.code,
                        "verdict": r.verdict,
                        "seconds": round(r.seconds, 2),
                        "peak_mib": r.peak_bytes >> 20,
                        "stderr": r.stderr[-2000:],
                    }
                    for r in results
                ],
                indent=1,
                ensure_ascii=True,
            )
        )
    bugs = [r for r in results if r.bug]
    for r in bugs[: args.show]:
        print(
            f"\n--- {r.verdict}: {r.case.kind} seed {r.case.seed}: {r.case.what}\n    argv {r.case.argv[1:]}"
        )
        print("    " + "\n    ".join(r.stderr.strip().splitlines()[-6:]))
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
