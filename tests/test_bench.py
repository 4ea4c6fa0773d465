"""The benchmark's machinery on the tiny llama fixture: prompts cut to length, every measurement of
inferno run in its own process, aggregated and printed (competitors only when importable)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferno.bench.figures import Plan, common_prefix
from inferno.bench.measure import Options, available, benchmark
from inferno.bench.prompts import english_text, exact_prompt
from inferno.bench.report import render
from inferno.file.reader import open_gguf
from inferno.text.tokenizer import GGUFTokenizer

TINY = Path(__file__).parent / "fixtures" / "tiny_llama.gguf"
# Small enough for the tiny model's 256-token context, and quick.
PLAN = Plan(prefill_tokens=40, deep_tokens=100, deep_new=4, decode_new=6)


@pytest.fixture(scope="module")
def tiny_tokenizer() -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(open_gguf(TINY))


def test_english_text_is_the_same_on_every_run():
    assert english_text(3) == english_text(3)
    assert english_text(3).count(".") == 3 and not any(c.isdigit() or c == "\n" for c in english_text(50))


@pytest.mark.parametrize("target", [1, 7, 40, 100])
def test_prompts_are_cut_to_the_exact_token_count(tiny_tokenizer, target):
    assert len(tiny_tokenizer.encode(exact_prompt(tiny_tokenizer, target))) == target


def test_competitors_are_skipped_exactly_when_not_importable():
    engines, skipped = available(["inferno", "llama.cpp", "llama.cpp-fa", "hf"], sys.executable)
    assert engines[0] == "inferno"
    has_llama = importlib.util.find_spec("llama_cpp") is not None
    for llama in ("llama.cpp", "llama.cpp-fa"):
        assert (llama in engines) == has_llama and (llama in skipped) != has_llama
    if "hf" in skipped:
        assert "torch, transformers, gguf not importable" in skipped["hf"]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1], [1, 2]) == 1 and common_prefix([], [1]) == 0


def test_the_bench_measures_inferno_in_child_processes(capsys):
    logged: list[str] = []
    result = benchmark(Options(TINY, threads=1, ctx=256, warm_up=False), PLAN, ["inferno"], logged.append)
    assert result["errors"] == [] and result["plan"]["prefill_tokens"] == 40
    inferno = result["engines"]["inferno"]
    figures = inferno["figures"]
    assert set(figures) == set(PLAN.figures) and all(v > 0 for v in figures.values()), figures
    assert [run["measure"] for run in inferno["runs"]] == list(PLAN.measures)
    assert inferno["version"].startswith("inferno ") and inferno["sample"]
    # The children are real processes of their own: each loads the model and a Python (tens of MiB).
    assert all(run["child_peak_rss_mib"] > 20 for run in inferno["runs"])
    assert len(logged) == len(PLAN.measures)
    json.dumps(result)  # what --json prints

    render(result)
    out = capsys.readouterr().out
    assert "inferno bench" in out and "tiny_llama.gguf" in out and "tok/s @40" in out and "@100" in out


# A harness that allocates 400 MB, in itself or aside, then measures a child that allocates nothing.
_FLOOR = """
import sys
from inferno.bench.processes import aside, run_child

ALLOCATE = "import numpy; numpy.ones(50_000_000).sum()"  # 400 MB, touched
aside(exec, ALLOCATE) if sys.argv[1] == "aside" else exec(ALLOCATE)
print(run_child([sys.executable, "-c", "print('{}')"], {}, 60).peak_rss_mib)
"""


def test_work_done_aside_is_not_the_floor_of_a_measured_childs_peak_rss():
    def child_rss(where: str) -> float:
        cmd = [sys.executable, "-c", _FLOOR, where]
        return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)

    assert child_rss("here") > 380  # Linux starts a child's peak at its parent's high-water mark
    assert child_rss("aside") < 200  # a Python with nothing to do: tens of MiB


def test_bad_flags_are_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "inferno.bench", "--engines", "inferno,vllm"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == ("python -m inferno.bench: error: unknown engine(s) vllm; "
                                   "choose from inferno, llama.cpp, llama.cpp-fa, hf")


def test_the_matvec_bench_runs_on_a_tiny_model():
    model = TINY.with_name("tiny_qwen3.gguf")  # its 2-D weights are Q8_0
    cmd = [sys.executable, "-m", "inferno.bench.matvec", "--model", str(model), "--no-compile",
           "--threads", "1", "--seconds", "0.05"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
    assert rows["attn_q"][1:3] == ["Q8_0", "128x64"] and rows["token_embd"][1:3] == ["Q8_0", "320x64"]
    assert rows["decode"][:3] == ["decode", "pass", "mixed"]  # every matrix, in the model's order
    assert "threads=1" in rows


def test_the_sgemm_peak_counts_the_prefill_products_of_the_model():
    from inferno.bench import sgemm_peak
    from inferno.file.config import ModelConfig

    config = ModelConfig.from_gguf(open_gguf(TINY))
    per_layer = sum(n * m for n, m in sgemm_peak.product_shapes(config))
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    assert per_layer == config.hidden_size * (2 * q + 2 * kv + 3 * config.ffn_size)
    got = sgemm_peak.in_process(str(TINY), tokens=16, threads=1, rounds=1)
    assert got["gflop"] == pytest.approx(2 * 16 * per_layer * config.n_layers / 1e9)
    assert got["seconds"] > 0 and got["tok_s"] == pytest.approx(16 / got["seconds"])


def test_the_host_read_rate_is_the_bytes_over_the_median_pass(monkeypatch):
    from inferno.bench import host_read

    # passes of 9 s (the untimed first), then 1, 5 and 2 s: the median is 2
    ticks = iter([0, 9, 10, 11, 20, 25, 30, 32])
    monkeypatch.setattr(host_read, "perf_counter", lambda: next(ticks))
    assert host_read.read_rate(threads=3, mib=3, passes=3) == pytest.approx(3 * 2**20 / 2 / 1e9)
    monkeypatch.undo()
    assert 0.1 < host_read.read_rate(threads=2, mib=64, passes=2) < 10_000  # GB/s, for real


def test_ab_installs_a_version_under_its_own_name_with_its_imports_renamed(tmp_path):
    from inferno.bench.ab import install

    module = b"from inferno.kv import b\nname = 'inferno-share'\n"
    files = {"__init__.py": b"import inferno\n", "kv/a.py": module}
    name = install(files, tmp_path)
    assert name.startswith("inferno_") and install(files, tmp_path) == name  # named by content
    assert (tmp_path / name / "__init__.py").read_text() == f"import {name}\n"
    renamed = module.decode().replace("inferno.kv", f"{name}.kv")  # the string's name is left alone
    assert (tmp_path / name / "kv" / "a.py").read_text() == renamed
    assert install({**files, "__init__.py": b"import inferno  # changed\n"}, tmp_path) != name


def test_ab_runs_two_versions_in_one_process_and_compares_their_logits(tmp_path):
    env = {**os.environ, "INFERNO_CACHE_DIR": str(tmp_path)}

    def ab(model: Path, *args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "inferno.bench.ab", str(model), "worktree", "worktree", *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)

    run = ab(TINY, "--steps", "2", "--rounds", "2")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "logits bit for bit the same" in lines[0]
    assert [line.split(":")[0] for line in lines[1:]] == ["round 1", "round 2"]
    missing = ab(tmp_path / "none.gguf")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no such file" in missing.stderr
