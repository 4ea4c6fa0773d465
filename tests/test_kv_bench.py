"""kv-bench: every mode on the same prompt gives the same greedy tokens, its JSON and table, refusals."""

from __future__ import annotations

import json

import pytest

from inferno.bench.kv_modes import DEFAULT_MODES, summary_row
from inferno.cli.kv_bench import main

PROG = "kv-bench"


@pytest.fixture
def kv_bench(run_main, monkeypatch, loaded_once):
    """kv-bench in this process, with the session's engine."""
    monkeypatch.setenv("NO_COLOR", "1")
    return lambda *args: run_main(main, PROG, *args)


def test_json(kv_bench, engine):
    code, out, err = kv_bench("-n", "6", "--average", "2", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert set(r) == {"prompt_tokens", "new_tokens", "identical_tokens", "summary", "runs"}
    assert (r["prompt_tokens"], r["new_tokens"], r["identical_tokens"]) == (4, 6, True)
    assert list(r["summary"]) == list(r["runs"]) == list(DEFAULT_MODES)
    for mode in DEFAULT_MODES:
        row, run = r["summary"][mode], r["runs"][mode]
        assert set(row) == {"ttft_ms", "decode_tok_s", "first_forward_ms", "last_forward_ms",
                            "last_over_first", "cache_bytes", "kernels_ms"}
        assert len(run["token_ids"]) == 6 and len(run["metrics"]["per_forward_ms"]) == 6
        assert row == summary_row(run["metrics"], 2) | {"kernels_ms": row["kernels_ms"]}
        assert row["kernels_ms"] >= 0
        assert (row["cache_bytes"] == 0) == (mode == "off")
    # Greedy from one prompt: the tokens model-generate gives, whatever the cache.
    assert r["runs"]["off"]["token_ids"] == engine.generate("Once upon a time", 6, kv=None).token_ids


def test_table(kv_bench):
    code, out, err = kv_bench("-n", "4", "--modes", "off,prealloc", "--prompt", "Hi there")
    assert code == 0, err
    assert "KV cache modes, 2-token prompt, 4 new tokens" in out and "same tokens from every mode" in out
    assert "prealloc" in out and "basic" not in out and "o off   p prealloc" in out


def test_batch_sweep_json(kv_bench, engine):
    """B forks of one prompt, 3 greedy tokens each: every sequence generates what the prompt gives
    alone; the prompt's blocks are held once whatever B; aggregate rate = B x per-sequence rate."""
    code, out, err = kv_bench("--batch-sweep", "1,3", "-n", "3", "--block-size", "2", "--prompt",
                              "The capital of France is", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert (r["prompt_tokens"], r["new_tokens"], r["block_size"]) == (5, 3, 2)
    assert [row["batch"] for row in r["sweep"]] == [1, 3]
    block = 2 * 2 * 30 * 192 * 4  # K and V of 2 tokens, 30 layers of 192 floats
    for row in r["sweep"]:
        b = row["batch"]
        assert row["identical_tokens"] and row["decode_steps"] >= 1
        assert row["decode_tok_s"] == pytest.approx(b * row["per_sequence_tok_s"])
        assert row["reused_tokens"] == (b - 1) * 4  # the later sequences adopt the 2 full blocks
        # 2 full blocks shared, then per sequence positions 4..6 in blocks of its own (1 or 2 at a time:
        # the first sequence starts a step before the others and ends a step before them)
        assert (2 + b) * block <= row["peak_cache_bytes"] <= (2 + 2 * b) * block
        assert row["unshared_peak_bytes"] == b * 8 * block // 2
    code, out, err = kv_bench("--batch-sweep", "2", "-n", "3", "--prompt", "The capital of France is")
    assert code == 0, err
    assert "batch sweep: 5-token prompt, B x 3 greedy tokens" in out
    assert "every sequence of every batch generated the same tokens" in out


def test_summary_row_compares_the_last_decodes_with_the_first():
    metrics = {"per_forward_ms": [50.0, 1.0, 1.0, 2.0, 3.0, 3.0], "ttft_ms": 50.0, "decode_tok_s": 500.0,
               "cache_bytes": 10}
    row = summary_row(metrics, window=2)
    assert (row["first_forward_ms"], row["last_forward_ms"], row["last_over_first"]) == (1.0, 3.0, 3.0)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("--modes", "off,pages"), "unknown mode pages (valid: off, basic, prealloc"),
        (("--modes", ","), "unknown mode (none)"),
        (("-n", "1"), "--new-tokens must be at least 2, got 1"),
        (("--threads", "0"), "--threads must be at least 1"),
        (("--batch-sweep", "1,x"), "batch sizes are whole numbers separated by commas, got '1,x'"),
        (("--batch-sweep", "0,2"), "batch sizes must be at least 1, got '0,2'"),
        (("--batch-sweep", "2", "--block-size", "0"), "--block-size must be at least 1, got 0"),
        (("--batch-sweep", "2", "--fidelity"), "--batch-sweep and --fidelity do not go together"),
        (("--window", "8"), "kv-bench's --window is now --average 8 (decode steps averaged)"),
        (("--average", "0"), "--average must be at least 1, got 0"),
        (("--plot", "x.pdf"), "--plot x.pdf: the file name must end in .svg or .png"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(kv_bench, args, fragment):
    code, out, err = kv_bench(*args)
    line = err.strip()
    assert code == 2 and out == "" and "\n" not in line
    assert line.startswith(f"{PROG}: error: ") and fragment in line
