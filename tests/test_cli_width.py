"""80 columns: every command's tables fit an 80-column terminal with no header cut short (`last/fi…`) and
no cell wrapped (`495.00` over `KiB`), and what goes into a pipe or file has no trailing spaces."""

from __future__ import annotations

import re

import pytest

from inferno.cli import display
from inferno.cli.common import console

WIDTH = 80
UNIT_ALONE = re.compile(r"(^|\s{2})(KiB|MiB|GiB)(\s{2}|$)")  # a unit whose number wrapped away


def check(text: str) -> None:
    assert text.strip()
    for line in text.splitlines():
        assert len(line) <= WIDTH, f"{len(line)} columns: {line!r}"
        assert line == line.rstrip(), f"trailing spaces: {line!r}"
        assert "…" not in line, f"cut short: {line!r}"
        assert not UNIT_ALONE.search(line), f"a wrapped cell: {line!r}"


@pytest.fixture
def narrow(monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    monkeypatch.setenv("NO_COLOR", "1")


def rendered(capsys, renderable) -> str:
    capsys.readouterr()
    console().print(renderable)  # stdout is not a terminal here: as into a pipe
    return capsys.readouterr().out


# -- the tables, at their widest: long labels, big numbers -----------------------------------------


def test_bench_table(narrow, capsys):
    big = {"ttft_ms": 123456.7, "decode_tok_s": 1234.5, "first_forward_ms": 12345.67,
           "last_forward_ms": 12345.67, "last_over_first": 123.45, "cache_bytes": 1023 << 20,
           "kernels_ms": 12345.0}
    rows = {"off": big | {"cache_bytes": 0}, "prealloc/q4_recent": big,
            "window/q8_0h": big | {"kernels_ms": 0}}
    text = rendered(capsys, display.bench_table(rows, 2048, 1024, 32))
    check(text)
    lines = text.splitlines()
    assert lines[0] == "KV cache modes, 2048-token prompt, 1024 new tokens"
    assert [line.split()[0] for line in lines[4:7]] == list(rows)  # one line each: nothing wrapped
    assert "1023 MiB" in lines[5] and "123.45x" in lines[5]
    assert "prealloc/q4_recent 12,345 ms" in " ".join(lines[7:])


def test_sweep_table(narrow, capsys):
    rows = [{"batch": b, "decode_tok_s": 12345.6, "per_sequence_tok_s": 1234.5, "step_ms": 1234.5,
             "reused_tokens": 123456, "peak_cache_bytes": 999 << 30, "unshared_peak_bytes": 1000 << 30}
            for b in (1, 16, 256)]
    text = rendered(capsys, display.sweep_table(rows, 2048, 128, 16, "int8"))
    check(text)
    lines = text.splitlines()
    assert [line.split()[0] for line in lines[-4:]] == ["─" * len(lines[-4]), "1", "16", "256"]  # unwrapped


def test_fidelity_table(narrow, capsys):
    rows = [{"dtype": d, "activations": a, "bits_per_value": 4.484375, "cache_bytes": 123 << 20,
             "top1_agreement": 0.9706, "kl_mean": 6.53e-3, "kl_max": 12.345, "perplexity": 123.456,
             "decode_ms": 123.45, "kernels_ms": 1234.0} for d, a in (("f32", "f32"), ("q4_recent", "int8"))]
    text = rendered(capsys, display.fidelity_table(rows, "execution_model.txt", 1024))
    check(text)
    assert any(line.startswith("q4_recent int8 ") for line in text.splitlines())


def test_metrics_panel_of_a_long_run(narrow, capsys):
    from inferno.runtime.metrics import Metrics, RunRecord, Startup

    metrics = Metrics(prompt_tokens=4096, prefilled_tokens=4096, generated_tokens=512,
                      per_forward_ms=[1234.5] + [12.34] * 511, ttft_ms=1234.5, decode_ms=6000.0,
                      cache="window", cache_dtype="q4_recent", cache_bytes=123 << 20, cache_capacity=8192,
                      evicted_tokens=12345, activations="int8")
    startup = Startup(load_ms=1234.0, jit_ms=12345.0, model_cache="miss", imports_ms=456.0)
    record = RunRecord(model="m.gguf", prompt="", text="", prompt_ids=[], token_ids=[],
                       finish_reason="length", metrics=metrics, startup=startup, wall_ms=12345.0,
                       load_cache_ms=12.0)
    capsys.readouterr()
    err = console(stderr=True)
    err.print(display.metrics_panel(record, err.width))
    check(capsys.readouterr().err)


# -- the commands themselves -----------------------------------------------------------------------


@pytest.fixture
def command(narrow, run_main, loaded_once):
    import importlib

    def run(module: str, *args) -> tuple[str, str]:
        main = importlib.import_module(f"inferno.cli.{module}").main
        code, out, err = run_main(main, module, *args)
        assert code == 0, err
        return out, err

    return run


def test_model_generate_metrics(command):
    out, err = command("generate", "--kv", "window", "--window", "8", "Once upon a time", "12")
    check(err)
    assert "Metrics" in err and out.strip()


def test_kv_bench_tables(command):
    out, _ = command("kv_bench", "-n", "3", "--modes", "off,prealloc,paged")
    check(out)
    out, _ = command("kv_bench", "--batch-sweep", "1,2", "-n", "2")
    check(out)
    out, _ = command("kv_bench", "--fidelity", "--tokens", "4", "--kv-dtype", "q8_0")
    check(out)


def test_kv_inspect_tables(command):
    out, _ = command("inspect", "--kv", "paged", "--num-samples", "3", "--block-size", "2", "--layer", "3",
                     "--kv-dtype", "q8_0", "Once upon a time, in a land far away, there lived a")
    check(out)
    out, _ = command("inspect", "--kv", "window", "--window", "4", "--sinks", "2", "--layer", "0",
                     "Once upon a time, in a land far away")
    check(out)


@pytest.mark.parametrize("args", [
    ["--layers", "80", "--kv-heads", "8", "--heads", "64", "--batch", "64", "--budget", "80GiB"],
    ["--layers", "80", "--kv-heads", "8", "--gpus", "8x80GiB", "--context", "128k", "--weights", "140GB"],
    ["--layers", "62", "--kv-heads", "16", "--head-dim", "128", "--sliding-window", "1024",
     "--sliding-pattern", "6", "--context", "2k,32k,128k"],
])
def test_kv_memcalc_tables(narrow, run_main, args):
    from inferno.cli.memcalc import main

    code, out, err = run_main(main, "kv-memcalc", *args)
    assert code == 0, err
    check(out)


def test_kv_memcalc_of_a_model(narrow, run_main, model_path):
    from inferno.cli.memcalc import main

    code, out, err = run_main(main, "kv-memcalc", "--model", model_path, "--kv", "paged",
                              "--kv-dtype", "q8_0")
    assert code == 0, err
    check(out)
