"""kv-memcalc: the arithmetic, what users type, GGUF metadata, the JSON and the one-line errors."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from click.testing import CliRunner
from conftest import DEFAULT_MODEL, FIXTURES, GEMMA_MODEL, QWEN_MODEL

from inferno.cli import memcalc as memcalc_cli
from inferno.cli.memcalc import command, main
from inferno.errors import InfernoError
from inferno.file.config import ModelConfig
from inferno.file.hparams import model_info, pattern_layers, read_model_info
from inferno.file.reader import open_gguf
from inferno.kv import KVGeometry, make_cache
from inferno.kv.dtypes import ELEMENT_TYPES
from inferno.plan.deploy import Devices, device_shape, engine_plans, limiting, plan_stages, pp_stages
from inferno.plan.hf_config import Weights, read_hf_config
from inferno.plan.memcalc import (
    DTYPES,
    bytes_per_token,
    cache_bytes,
    default_contexts,
    kv_heads_by_layer,
    kv_shape,
    max_batch,
    max_context,
    parse_contexts,
    parse_count,
    parse_layers,
    parse_size,
    resolve_shape,
    row_bytes,
)
from inferno.plan.report import human

GiB = 2**30


def cli(flags: str, *more: str) -> str:
    """Run the command in-process at 80 columns with `flags` split on spaces plus `more` (e.g. paths)."""
    result = CliRunner(env={"COLUMNS": "80", "NO_COLOR": "1"}).invoke(command, [*flags.split(), *more])
    assert result.exit_code == 0, result.output
    return result.output


def cli_json(flags: str, *more: str) -> dict:
    return json.loads(cli(flags, *more, "--json"))


def write_gguf(path: Path, arch: str, fields: dict) -> Path:
    """A metadata-only GGUF: `fields` maps keys under `{arch}.` to ints or per-layer lists."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- the arithmetic -------------------------------------------------------------------------------


def test_seed_small_model_is_8_mib():
    shape = kv_shape(layers=4, kv_heads=8, head_dim=64)
    assert cache_bytes(shape, DTYPES["f32"], 512) == 8 * 2**20


def test_seed_64_layers_bf16_128000_tokens_and_multi_head_is_8x():
    shape = kv_shape(layers=64, kv_heads=8, head_dim=128, heads=64)
    size = cache_bytes(shape, DTYPES["bf16"], 128_000)
    assert size == 33_554_432_000
    assert size / 10**9 == pytest.approx(33.55, abs=0.005)
    assert size / GiB == 31.25
    assert cache_bytes(shape, DTYPES["bf16"], 128_000, mha=True) == 8 * size


def test_formula_counts_k_and_v_layers_tokens_heads_dim_bytes_and_batch():
    shape = kv_shape(layers=3, kv_heads=2, head_dim=32)
    for name, width in (("f32", 4), ("f16", 2), ("bf16", 2), ("fp8", 1)):
        assert cache_bytes(shape, DTYPES[name], 100, batch=5) == 2 * 3 * 100 * 2 * 32 * width * 5
    assert bytes_per_token(shape, DTYPES["f16"]) == 2 * 3 * 2 * 32 * 2


def test_block_formats_count_their_scales():
    assert row_bytes(8 * 128, DTYPES["q8_0"]) == 32 * 34
    assert row_bytes(8 * 128, DTYPES["q4_0"]) == 32 * 18
    shape = kv_shape(layers=64, kv_heads=8, head_dim=128)
    assert cache_bytes(shape, DTYPES["q8_0"], 1000) == 2 * 64 * 1000 * (1024 // 32) * 34


def test_block_formats_refuse_rows_that_are_not_whole_blocks():
    with pytest.raises(InfernoError, match="blocks of 32"):
        cache_bytes(kv_shape(layers=2, kv_heads=3, head_dim=10), DTYPES["q4_0"], 10)


def test_sliding_layers_hold_at_most_the_window():
    shape = kv_shape(layers=12, kv_heads=1, head_dim=32, window=1024, sliding=pattern_layers(12, 6))
    per_layer_token = 2 * 32 * 2
    assert cache_bytes(shape, DTYPES["f16"], 4096) == per_layer_token * (10 * 1024 + 2 * 4096)
    assert cache_bytes(shape, DTYPES["f16"], 512) == per_layer_token * 12 * 512


def test_per_layer_kv_heads_and_layers_without_a_cache():
    shape = kv_shape(layers=4, kv_heads=[4, 0, 2, 2], head_dim=32, heads=8)
    assert cache_bytes(shape, DTYPES["f32"], 10) == 2 * 10 * (4 + 0 + 2 + 2) * 32 * 4
    assert cache_bytes(shape, DTYPES["f32"], 10, mha=True) == 2 * 10 * (8 + 0 + 8 + 8) * 32 * 4


@pytest.mark.parametrize("batch", [1, 3])
def test_max_context_is_the_largest_that_fits(batch):
    shape = kv_shape(layers=64, kv_heads=8, head_dim=128)
    budget = 24 * GiB
    longest = max_context(shape, DTYPES["bf16"], budget, batch)
    assert cache_bytes(shape, DTYPES["bf16"], longest, batch) <= budget
    assert cache_bytes(shape, DTYPES["bf16"], longest + 1, batch) > budget
    assert max_context(shape, DTYPES["bf16"], 100, batch) == 0


def test_max_context_with_sliding_layers_and_when_only_sliding_layers_hold_a_cache():
    gemma = kv_shape(layers=12, kv_heads=1, head_dim=32, window=1024, sliding=pattern_layers(12, 6))
    budget = cache_bytes(gemma, DTYPES["f16"], 50_000)
    assert max_context(gemma, DTYPES["f16"], budget, 1) == 50_000
    every = kv_shape(layers=4, kv_heads=1, head_dim=32, window=1024, sliding=range(4))
    assert max_context(every, DTYPES["f16"], 10 * GiB, 1) is None
    assert max_context(every, DTYPES["f16"], cache_bytes(every, DTYPES["f16"], 100), 1) == 100


def test_max_batch():
    shape = kv_shape(layers=64, kv_heads=8, head_dim=128)
    one = cache_bytes(shape, DTYPES["bf16"], 8192)
    assert max_batch(shape, DTYPES["bf16"], 10 * one + 1, 8192) == 10
    assert max_batch(shape, DTYPES["bf16"], one - 1, 8192) == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(layers=0, kv_heads=8, head_dim=64), "layers must be a positive"),
        (dict(layers=4, kv_heads=-1, head_dim=64), "KV heads must be a positive"),
        (dict(layers=4, kv_heads=8, head_dim=0), "head dim must be a positive"),
        (dict(layers=4, kv_heads=8, head_dim=64, heads=12), r"query heads \(12\) are not a multiple"),
        (dict(layers=4, kv_heads=8, head_dim=64, heads=4), r"query heads \(4\) are not a multiple"),
        (dict(layers=2, kv_heads=[0, 0], head_dim=64), "no layer has KV heads"),
        (dict(layers=2, kv_heads=[1, 2, 3], head_dim=64), "3 layers, but there are 2"),
        (dict(layers=2, kv_heads=8, head_dim=64, sliding={0}), "need a window size"),
        (dict(layers=2, kv_heads=8, head_dim=64, window=8, sliding={2}), "layer 2 does not exist"),
    ],
)
def test_bad_shapes(kwargs, message):
    with pytest.raises(InfernoError, match=message):
        kv_shape(**kwargs)


def test_the_planner_sizes_from_the_caches_own_table_of_element_types():
    assert all(dtype is ELEMENT_TYPES[name] for name, dtype in DTYPES.items())
    assert [name for name, dtype in DTYPES.items() if not dtype.held] == ["bf16", "fp8"]
    with pytest.raises(InfernoError, match="'bf16' is not one of"):  # sized for vLLM, never held
        make_cache("prealloc", KVGeometry(1, 1, 1, 32), 4, "bf16")


def test_per_layer_heads_and_mla_are_geometries_the_caches_refuse():
    assert kv_shape(layers=2, kv_heads=[2, 2], head_dim=32) == KVGeometry(2, 2, 0, 32)  # one spelling
    mixed = kv_shape(layers=2, kv_heads=[2, 4], head_dim=32, heads=8)
    mla = kv_shape(layers=2, kv_heads=1, head_dim=576, heads=128, mla=True)
    assert (mixed.rows, mla.rows) == (2, 1)
    for geometry in (mixed, mla):
        with pytest.raises(InfernoError, match="layers of one shape"):
            make_cache("prealloc", geometry, 4)


# --- parsing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, tokens",
    [("128k", 131_072), ("128K", 131_072), ("2k", 2048), ("128000", 128_000), ("1m", 2**20), ("1_000", 1000)],
)
def test_parse_count(text, tokens):
    assert parse_count(text) == tokens


@pytest.mark.parametrize("text", ["0", "-5", "1.5k", "abc", "", "12kb", "0k"])
def test_parse_count_rejects(text):
    with pytest.raises(InfernoError):
        parse_count(text)


def test_parse_contexts_lists_and_repeats_keep_order_and_drop_repeats():
    assert parse_contexts(["8k,2k", "4096", "2k"]) == [8192, 2048, 4096]


def test_parse_contexts_refuses_thousands_separators():
    with pytest.raises(InfernoError, match="ambiguous"):
        parse_contexts(["128,000"])


@pytest.mark.parametrize(
    "text, size",
    [
        ("24GiB", 24 * GiB),
        ("24 gib", 24 * GiB),
        ("24GB", 24 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("1.1GB", 1_100_000_000),
        ("512MiB", 512 * 2**20),
        ("512mb", 512 * 10**6),
        ("2KiB", 2048),
        ("2kB", 2000),
        ("1TiB", 2**40),
        ("1TB", 10**12),
        ("1000", 1000),
        ("1000B", 1000),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "text, message",
    [
        ("24G", "ambiguous"),
        ("24XB", "not understood"),
        ("0", "at least 1 byte"),
        ("-3GB", "at least 1 byte"),
        ("1.5", "whole number of bytes"),
        ("GiB", "not understood"),
    ],
)
def test_parse_size_rejects(text, message):
    with pytest.raises(InfernoError, match=message):
        parse_size(text)


def test_parse_layers():
    assert parse_layers("0-4,6-10", 12) == frozenset([0, 1, 2, 3, 4, 6, 7, 8, 9, 10])
    assert parse_layers("3", 12) == frozenset([3])
    assert parse_layers("all", 3) == frozenset([0, 1, 2])
    for bad in ("0-12", "4-2", "a-b", "1,,2"):
        with pytest.raises(InfernoError):
            parse_layers(bad, 12)


def test_pattern_layers_follows_gemma3_every_sixth_layer_is_global():
    assert pattern_layers(12, 6) == parse_layers("0-4,6-10", 12)
    assert pattern_layers(4, 2) == frozenset([0, 2])
    assert pattern_layers(5, 1) == frozenset()


def test_default_contexts():
    assert default_contexts() == [2048 * 2**i for i in range(7)]
    assert default_contexts(8192) == [2048, 4096, 8192]
    assert default_contexts(10_000) == [2048, 4096, 8192, 10_000]
    assert default_contexts(1000) == [1000]


# --- GGUF metadata --------------------------------------------------------------------------------


def test_model_info_derives_head_dim_and_defaults_kv_heads_to_heads():
    meta = {"general.architecture": "x", "x.block_count": 2, "x.attention.head_count": 4}
    info = model_info({**meta, "x.embedding_length": 256}.get)
    assert (info.layers, info.kv_heads, info.heads, info.head_dim) == (2, (4, 4), (4, 4), 64)
    assert info.sliding is None


def test_model_info_refuses_missing_keys():
    with pytest.raises(InfernoError, match=r"general\.architecture"):
        model_info({}.get)
    with pytest.raises(InfernoError, match="block_count"):
        model_info({"general.architecture": "x"}.get)
    with pytest.raises(InfernoError, match="head_count"):
        model_info({"general.architecture": "x", "x.block_count": 2}.get)


@pytest.mark.parametrize(
    "path",
    [FIXTURES / "tiny_llama.gguf", FIXTURES / "tiny_qwen3.gguf", DEFAULT_MODEL, GEMMA_MODEL, QWEN_MODEL],
    ids=lambda path: path.stem,
)
def test_the_planner_and_the_runtime_read_one_geometry_from_a_file(path):
    if not path.is_file():
        pytest.skip(f"{path.name} is absent")
    reader = open_gguf(path)
    assert resolve_shape(read_model_info(reader)) == ModelConfig.from_gguf(reader).kv_geometry


def test_the_runtime_refuses_heads_that_differ_by_layer_which_the_planner_sizes(tmp_path):
    fields = {"block_count": 2, "embedding_length": 64, "attention.head_count": 4,
              "attention.head_count_kv": [2, 1]}  # fmt: skip
    path = write_gguf(tmp_path / "mixed.gguf", "llama", fields)
    with pytest.raises(InfernoError, match="head_count_kv differs between layers"):
        ModelConfig.from_gguf(open_gguf(path))
    assert kv_heads_by_layer(resolve_shape(read_model_info(open_gguf(path)))) == (2, 1)


def test_different_key_and_value_sizes_need_head_dim():
    meta = {
        "general.architecture": "x",
        "x.block_count": 2,
        "x.attention.head_count_kv": 1,
        "x.attention.key_length": 192,
        "x.attention.value_length": 128,
    }
    info = model_info(meta.get)
    with pytest.raises(InfernoError, match="--head-dim"):
        resolve_shape(info)
    assert resolve_shape(info, head_dim=192).head_dim == 192


def test_flags_override_the_file():
    meta = {"general.architecture": "x", "x.block_count": 4, "x.attention.head_count_kv": [2, 2, 4, 4]}
    info = model_info({**meta, "x.attention.key_length": 64}.get)
    assert kv_heads_by_layer(resolve_shape(info)) == (2, 2, 4, 4)
    assert kv_heads_by_layer(resolve_shape(info, kv_heads=8, layers=6)) == (8,) * 6
    with pytest.raises(InfernoError, match="also needs --kv-heads"):
        resolve_shape(info, layers=6)


# --- the command ----------------------------------------------------------------------------------


def test_the_issue_command_as_typed_prints_a_table_from_2k_to_128k():
    out = cli("--layers 64 --kv-heads 8")
    assert "64 layers x 8 KV heads x head dim 128, f16, batch 1" in out
    assert "262,144 B (256.00 KiB / 262.14 kB)" in out
    assert "2,048" in out and "131,072" in out
    assert "32.00 GiB / 34.36 GB" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    assert "\x1b[" not in out


def test_seed_figures_in_text_and_json():
    out = cli("--layers 64 --kv-heads 8 --head-dim 128 --context 128000 --dtype bf16")
    assert "33,554,432,000" in out and "31.25 GiB / 33.55 GB" in out
    small = cli_json("--layers 4 --kv-heads 8 --head-dim 64 --context 512 --dtype f32")
    assert "8.00 MiB / 8.39 MB" in cli("--layers 4 --kv-heads 8 --head-dim 64 --context 512 --dtype f32")
    assert small["rows"] == [{"context": 512, "batch": 1, "dtype": "f32", "bytes": 8 * 2**20}]


def test_heads_show_multi_head_size_and_the_saving():
    args = "--layers 64 --kv-heads 8 --heads 64 --context 128000 --dtype bf16"
    out = cli(args)
    assert "MHA (64 heads)" in out and "250.00 GiB / 268.44 GB" in out
    assert "8.00x" in out and "87.5%" in out
    report = cli_json(args)
    assert report["rows"][0]["mha_bytes"] == 8 * 33_554_432_000
    assert report["mha_bytes_per_token"] == 8 * report["bytes_per_token"]


def test_json_shape_contexts_batch_and_budget():
    report = cli_json(
        "--layers 64 --kv-heads 8 --context 2k,8k --context 128k --batch 2 --dtype q8_0 --budget 24GiB"
    )
    assert report["bytes_per_token"] == 64 * 2 * 32 * 34
    assert [row["context"] for row in report["rows"]] == [2048, 8192, 131_072]
    assert all(row["batch"] == 2 and row["dtype"] == "q8_0" for row in report["rows"])
    assert report["rows"][0]["bytes"] == 2 * 2048 * report["bytes_per_token"]
    assert report["budget"] == 24 * GiB
    assert report["max_context"] == 24 * GiB // (2 * report["bytes_per_token"])
    assert report["max_batch"] == 24 * GiB // (131_072 * report["bytes_per_token"])
    assert report["rows"][0]["max_batch"] == 24 * GiB // (2048 * report["bytes_per_token"])


def test_budget_in_text():
    out = cli("--layers 64 --kv-heads 8 --context 128000 --budget 24GiB --dtype bf16")
    assert "budget 24.00 GiB / 25.77 GB" in out
    assert "longest context at batch 1: 98,304 tokens" in out
    assert "largest batch at 128,000 tokens: 0 (does not fit)" in out
    assert all(len(line) <= 80 for line in out.splitlines())


def test_wide_tables_give_up_the_bytes_column_to_fit_80_columns():
    out = cli("--layers 64 --kv-heads 8 --heads 64 --dtype f32 --context 1m --batch 16 --budget 24GiB")
    assert all(len(line) <= 80 for line in out.splitlines())
    assert "8.00 TiB / 8.80 TB" in out and "64.00 TiB / 70.37 TB" in out


def test_sliding_flags():
    base = "--layers 12 --kv-heads 1 --head-dim 32 --context 4096 --sliding-window 1024"
    by_pattern = cli_json(f"{base} --sliding-pattern 6")
    by_list = cli_json(f"{base} --sliding-layers 0-4,6-10")
    assert by_pattern["rows"] == by_list["rows"]
    assert by_pattern["sliding_layers"] == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert by_pattern["rows"][0]["bytes"] == 2 * 32 * 2 * (10 * 1024 + 2 * 4096)
    assert by_pattern["bytes_per_token_beyond_window"] == 2 * 2 * 32 * 2
    assert "10 of 12 layers hold at most 1,024 tokens" in cli(f"{base} --sliding-pattern 6")


@pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="default model not fetched (make model)")
def test_default_model(monkeypatch):
    # Parsing the tokenizer's metadata arrays takes seconds: read the file once for both runs.
    monkeypatch.setattr(memcalc_cli, "read_model", functools.cache(memcalc_cli.read_model))
    report = cli_json("--model", str(DEFAULT_MODEL))
    assert (report["layers"], report["kv_heads"], report["heads"], report["head_dim"]) == (30, 3, 9, 64)
    assert report["model"] == {"file": DEFAULT_MODEL.name, "arch": "llama", "context_length": 8192}
    assert [row["context"] for row in report["rows"]] == [2048, 4096, 8192]
    assert report["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert report["rows"][-1]["mha_bytes"] == 3 * report["rows"][-1]["bytes"]
    out = cli("--layers 10 --context 100 --dtype f32 --model", str(DEFAULT_MODEL))
    assert "SmolLM2-135M-Instruct.Q4_1.gguf: llama, context length 8,192" in out
    assert "10 layers x 3 KV heads x head dim 64, f32" in out
    assert f"{2 * 10 * 100 * 3 * 64 * 4:,}" in out


def test_gemma3_file_slides_five_layers_in_six(tmp_path):
    path = write_gguf(
        tmp_path / "gemma3.gguf",
        "gemma3",
        {
            "block_count": 12,
            "context_length": 32_768,
            "attention.head_count": 4,
            "attention.head_count_kv": 1,
            "attention.key_length": 256,
            "attention.value_length": 256,
            "attention.sliding_window": 512,
        },
    )
    report = cli_json("--context 32k --model", str(path))
    assert report["sliding_window"] == 512
    assert report["sliding_layers"] == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]
    per_layer_token = 2 * 256 * 2
    assert report["rows"][0]["bytes"] == per_layer_token * (10 * 512 + 2 * 32_768)
    assert cli_json("--sliding-window 1024 --model", str(path))["sliding_window"] == 1024
    assert "sliding_window" not in cli_json("--sliding-pattern 1 --model", str(path))


def test_file_with_a_per_layer_pattern_and_per_layer_kv_heads(tmp_path):
    path = write_gguf(
        tmp_path / "mixed.gguf",
        "mixed",
        {
            "block_count": 4,
            "attention.head_count": 8,
            "attention.head_count_kv": [4, 0, 2, 2],
            "attention.key_length": 64,
            "attention.sliding_window": 100,
            "attention.sliding_window_pattern": [True, False, True, False],
        },
    )
    report = cli_json("--context 1000 --dtype f32 --model", str(path))
    assert report["kv_heads"] == [4, 0, 2, 2]
    assert report["sliding_layers"] == [0, 2]
    assert report["rows"][0]["bytes"] == 2 * 64 * 4 * (4 * 100 + 0 + 2 * 100 + 2 * 1000)
    assert cli_json("--kv-heads 2 --model", str(path))["kv_heads"] == 2


def test_a_window_without_a_layer_pattern_is_noted_and_not_applied(tmp_path):
    path = write_gguf(
        tmp_path / "unknown.gguf",
        "unknown",
        {
            "block_count": 2,
            "attention.head_count": 2,
            "attention.key_length": 64,
            "attention.sliding_window": 9,
        },
    )
    result = CliRunner().invoke(command, ["--model", str(path), "--context", "1000", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["rows"][0]["bytes"] == 2 * 2 * 1000 * 2 * 64 * 2
    assert "does not say which layers" in result.stderr


# --- bad input: one line on stderr, exit code 2 ---------------------------------------------------


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["kv-memcalc", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


SHAPE = ("--layers", "64", "--kv-heads", "8")


@pytest.mark.parametrize(
    "args, message",
    [
        (("--layers", "0", "--kv-heads", "8"), "--layers"),
        (("--layers", "-4", "--kv-heads", "8"), "--layers"),
        (("--layers", "1.5", "--kv-heads", "8"), "not a whole number"),
        (("--layers", "64", "--kv-heads", "x"), "--kv-heads"),
        ((*SHAPE, "--head-dim", "0"), "--head-dim"),
        ((*SHAPE, "--batch", "0"), "--batch"),
        ((*SHAPE, "--heads", "12"), "not a multiple"),
        ((*SHAPE, "--dtype", "q5_k"), "--dtype"),
        ((*SHAPE, "--context", "0"), "at least 1 token"),
        ((*SHAPE, "--context", "-2k"), "at least 1 token"),
        ((*SHAPE, "--context", "1.5k"), "not a whole number"),
        ((*SHAPE, "--context", "128,000"), "ambiguous"),
        ((*SHAPE, "--budget", "24G"), "ambiguous"),
        ((*SHAPE, "--budget", "24 parsecs"), "not understood"),
        ((*SHAPE, "--budget", "0GB"), "at least 1 byte"),
        (("--layers", "64"), "--kv-heads"),
        (("--kv-heads", "8"), "--layers"),
        ((*SHAPE, "--head-dim", "10", "--dtype", "q4_0"), "blocks of 32"),
        ((*SHAPE, "--sliding-window", "1024"), "which layers"),
        ((*SHAPE, "--sliding-layers", "0-3"), "window size"),
        ((*SHAPE, "--sliding-window", "8", "--sliding-layers", "0-64"), "does not exist"),
        ((*SHAPE, "--sliding-window", "8", "--sliding-layers", "1", "--sliding-pattern", "2"), "not both"),
        ((*SHAPE, "--frobnicate"), "No such option"),
        (("--model", "no-such-file.gguf"), "no such file"),
        ((*SHAPE, "--budget", "9" * 5000), "5,000 digits"),  # more than Python reads into an int
        ((*SHAPE, "--context", "9" * 5000), "5,000 digits"),
        ((*SHAPE, "--batch", "9" * 31), "31 digits"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(monkeypatch, capsys, args, message):
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kv-memcalc: error: ")
    assert message in err


def test_non_gguf_and_broken_models_are_one_line(monkeypatch, capsys, tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    for path, message in ((text, "not a GGUF"), (cut, "corrupt"), (tmp_path, "directory")):
        code, _, err = run_main(monkeypatch, capsys, "--model", str(path))
        assert code == 2 and err.count("\n") == 1 and message in err


def test_sizes_past_a_floats_range_are_written_in_powers_of_ten():
    """30 digits of batch and context: bytes past 10^308, which a float division cannot take."""
    out = cli("--layers 64 --kv-heads 8 --batch 999999999999999999999999999999 --context "
              "999999999999999999999999999999 --budget 1TiB")
    assert "2.33e50 PiB / 2.62e50 PB" in out and "largest batch at 999,999" in out
    assert human(10**400) == "8.88e384 PiB" and human(3 * GiB) == "3.00 GiB"


def test_errors_reach_the_shell_without_a_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "inferno.cli.memcalc", "--layers", "64", "--kv-heads", "8", "--heads", "10"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr == "kv-memcalc: error: query heads (10) are not a multiple of KV heads (8)\n"
    assert result.stdout == ""


def test_the_installed_command_runs_the_issue_command():
    result = subprocess.run(
        [str(Path(sys.executable).with_name("kv-memcalc")), "--layers", "64", "--kv-heads", "8", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["rows"][-1] == {
        "context": 131_072,
        "batch": 1,
        "dtype": "f16",
        "bytes": 32 * GiB,
    }


# --- deployments: config.json, GPUs, tensor and pipeline parallelism, engines ---------------------

# Hand-written from the models' published config.json files; see tests/fixtures/hf_configs/README.md.
HF_CONFIGS = FIXTURES / "hf_configs"
LLAMA_70B = str(HF_CONFIGS / "llama-3.1-70b.json")
DEEPSEEK_V3 = str(HF_CONFIGS / "deepseek-v3.json")


def test_config_parameter_counts_match_the_published_checkpoints():
    # model.safetensors.index.json "total_size" of the bf16 checkpoints: 2 bytes per parameter.
    assert read_hf_config(LLAMA_70B).params.total * 2 == 141_107_412_992
    assert read_hf_config(HF_CONFIGS / "llama-3.1-8b.json").params.total * 2 == 16_060_522_496
    # DeepSeek-V3's report: 671B parameters in the main model (the MTP module's 14B aside).
    v3 = read_hf_config(DEEPSEEK_V3)
    assert v3.params.total / 1e9 == pytest.approx(671, abs=0.5)
    assert v3.weight_bits == 8  # quantization_config: fp8


def test_llama_70b_on_four_80gib_gpus_with_tp4_matches_the_readme_hand_calculation():
    d = cli_json("--gpus 4x80GiB --context 8k --config", LLAMA_70B)["deployment"]
    g = d["per_gpu"]
    weights = 70_553_706_496 * 2 // 4  # parameters x bf16 bytes / 4 ranks
    budget = 80 * GiB * 9 // 10 - weights
    per_token = 80 * 2 * (8 // 4) * 128 * 2  # layers x (K, V) x KV heads per rank x head dim x f16
    assert (g["weight_bytes"], g["cache_bytes"], g["kv_bytes_per_token"]) == (weights, budget, per_token)
    assert g["kv_bytes_per_token"] == 81_920
    assert g["blocks"] == budget // (16 * per_token) == 32_068
    assert g["max_batch"] == 32_068 // (8192 // 16) == 62
    assert g["max_context"] == 131_072  # the blocks hold 32_068 * 16 tokens; the model attends to 128k
    fp8 = cli_json("--gpus 4x80GiB --context 8k --dtype fp8 --config", LLAMA_70B)["deployment"]
    assert fp8["per_gpu"]["kv_bytes_per_token"] == 40_960
    assert fp8["per_gpu"]["blocks"] == budget // (16 * 40_960) == 64_136
    assert fp8["per_gpu"]["max_batch"] == 125
    vllm = fp8["engines"]["vllm"]
    assert vllm["args"][-2:] == ["--kv-cache-dtype", "fp8"] and "--tensor-parallel-size" in vllm["args"]
    assert vllm["kv_cache_tokens"] == 64_136 * 16
    out = cli("--gpus 4x80GiB --context 8k --config", LLAMA_70B)
    assert "KV per token     81,920 B" in out and "blocks           32,068 of 16 tokens" in out
    assert "largest batch    62 at 8,192 tokens" in out
    assert all(len(line) <= 80 for line in out.splitlines())


def test_overhead_and_given_weights_come_off_the_cache():
    base = cli_json("--gpus 4x80GiB --context 8k --config", LLAMA_70B)["deployment"]["per_gpu"]
    reserved = cli_json("--gpus 4x80GiB --overhead 3GiB --context 8k --config", LLAMA_70B)["deployment"]
    assert reserved["per_gpu"]["cache_bytes"] == base["cache_bytes"] - 3 * GiB
    given = cli_json("--gpus 4x80GiB --weights 100GB --context 8k --config", LLAMA_70B)["deployment"]
    assert given["weight_bytes"] == 10**11 and given["per_gpu"]["weight_bytes"] == 10**11 // 4
    int4 = cli_json("--gpus 4x80GiB --weight-dtype int4 --context 8k --config", LLAMA_70B)["deployment"]
    assert int4["weight_bytes"] == 70_553_706_496 // 2


def test_deepseek_v3_mla_caches_one_latent_row_replicated_on_every_rank():
    d = cli_json("--gpus 8x141GB --context 8k --dtype fp8 --config", DEEPSEEK_V3)
    per_token = 61 * (512 + 64) * 1  # layers x (kv_lora_rank + qk_rope_head_dim) x fp8, no V row
    assert d["bytes_per_token"] == per_token and d["mla"] is True
    g = d["deployment"]["per_gpu"]
    assert g["kv_bytes_per_token"] == per_token  # not divided by TP
    weights = -(-671_026_404_352 // 8)  # fp8: one byte per parameter, over 8 ranks
    budget = int(141 * 10**9 * 0.9) - weights
    assert (g["weight_bytes"], g["cache_bytes"]) == (weights, budget)
    assert g["blocks"] == budget // (16 * per_token)
    assert g["max_batch"] == g["blocks"] // 512
    assert "mha_bytes_per_token" not in d


@pytest.mark.parametrize(
    "memory_gib, blocks, context, concurrency",
    [(3.81, 1952, 20_000, 1.56), (2.89, 1478, 29_000, 0.82)],
)
def test_vllm_block_count_reproduces_a_published_log(memory_gib, blocks, context, concurrency):
    # vllm-project/vllm#10517, comment of 2024-12-02: Llama-3.1-8B-Instruct (bf16) on one RTX 3090
    # logged "kv_cache_size=3.81GiB ... # GPU blocks: 1952 ... Maximum concurrency for 20000 tokens per
    # request: 1.56x", and with 29k "kv_cache_size=2.89GiB", "# GPU blocks: 1478", "0.82x" and "the
    # maximum number of tokens that can be stored in KV cache (23648)". The log rounds GiB to 0.01,
    # so the blocks of the memory 0.005 GiB either side must bracket vLLM's count.
    shape = resolve_shape(read_hf_config(HF_CONFIGS / "llama-3.1-8b.json").info)
    nothing = Weights(0, 0, (0,) * 32)

    def vllm(gib: float) -> dict:
        dev = Devices(1, int(gib * GiB), 1, 1, 1.0, 0, 16)
        stage = limiting(plan_stages(shape, DTYPES["bf16"], nothing, dev, context))
        return engine_plans(shape, DTYPES["bf16"], dev, stage, context, "M", "M.gguf")["vllm"]

    low, high = vllm(memory_gib - 0.005), vllm(memory_gib + 0.005)
    assert low["num_gpu_blocks"] <= blocks <= high["num_gpu_blocks"] <= low["num_gpu_blocks"] + 6
    exact = vllm(blocks * 16 * 32 * 2 * 8 * 128 * 2 / GiB)
    assert exact["num_gpu_blocks"] == blocks
    assert exact["kv_cache_tokens"] == blocks * 16
    assert exact["max_concurrency"] == concurrency


def test_kv_heads_split_across_tp_ranks_and_replicate_when_fewer_than_ranks():
    shape = kv_shape(layers=2, kv_heads=8, head_dim=128, heads=64)
    assert kv_heads_by_layer(device_shape(shape, 4, range(2))) == (2, 2)
    assert kv_heads_by_layer(device_shape(shape, 16, range(2))) == (1, 1)  # 16 ranks share 8 heads: one each
    mqa = kv_shape(layers=2, kv_heads=1, head_dim=128, heads=8)
    assert kv_heads_by_layer(device_shape(mqa, 8, range(2))) == (1, 1)
    for tp in (3, 128):
        with pytest.raises(InfernoError, match="64 attention heads"):
            device_shape(shape, tp, range(2))
    odd = kv_shape(layers=1, kv_heads=6, head_dim=64, heads=24)
    with pytest.raises(InfernoError, match="6 KV heads"):
        device_shape(odd, 4, range(1))


def test_pipeline_stages_follow_vllms_get_pp_indices():
    # vllm/distributed/utils.py get_pp_indices: the remainder goes to the stages before the last.
    assert [len(s) for s in pp_stages(80, 3)] == [27, 27, 26]
    assert [len(s) for s in pp_stages(61, 4)] == [15, 15, 16, 15]
    assert pp_stages(4, 2) == [range(0, 2), range(2, 4)]


def test_pipeline_stages_hold_their_layers_and_the_ends_of_the_model():
    d = cli_json("--gpus 8x80GiB --tp 4 --pp 2 --context 8k --config", LLAMA_70B)["deployment"]
    first, last = d["stages"]
    assert first["layers"] == [0, 40] and last["layers"] == [40, 80]
    assert first["kv_bytes_per_token"] == last["kv_bytes_per_token"] == 40 * 2 * 2 * 128 * 2
    layer = (70_553_706_496 - 2 * 128_256 * 8192 - 8192) // 80  # one layer's parameters
    assert first["weight_bytes"] == -(-(40 * layer + 128_256 * 8192) * 2 // 4)
    assert d["per_gpu"] in d["stages"] and "--pipeline-parallel-size" in d["engines"]["vllm"]["args"]


def test_layer_types_mark_sliding_layers_and_vllm_blocks_are_not_guessed(tmp_path):
    config = tmp_path / "config.json"
    types = ["sliding_attention"] * 5 + ["full_attention"]
    config.write_text(
        json.dumps(
            {
                "model_type": "gemma3_text",
                "num_hidden_layers": 6,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 256,
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "vocab_size": 262_144,
                "sliding_window": 1024,
                "layer_types": types,
                "torch_dtype": "bfloat16",
            }
        )
    )
    report = cli_json("--context 32k --gpus 1x24GiB --config", str(config))
    assert report["sliding_layers"] == [0, 1, 2, 3, 4]
    assert report["rows"][0]["bytes"] == 2 * 4 * 256 * 2 * (5 * 1024 + 32_768)
    assert report["deployment"]["engines"]["vllm"]["num_gpu_blocks"] is None
    assert "block count not modelled" in cli("--context 32k --gpus 1x24GiB --config", str(config))


def test_a_gguf_deployment_places_the_files_tensor_bytes(model_path):
    tensors = gguf.GGUFReader(model_path).tensors
    d = cli_json("--gpus 1x8GiB --context 4k --dtype q8_0 --model", str(model_path))["deployment"]
    assert d["weight_bytes"] == sum(int(t.n_bytes) for t in tensors)
    assert d["engines"]["llama.cpp"]["args"][-4:] == ["-ctk", "q8_0", "-ctv", "q8_0"]
    assert "vllm" not in d["engines"]  # vLLM has no q8_0 cache


@pytest.mark.parametrize(
    "args, message",
    [
        (("--config", "MALFORMED", "--gpus", "1x80GiB"), "not valid JSON"),
        (("--config", "LIST"), "not a JSON object"),
        (("--config", "NO_LAYERS"), "has no num_hidden_layers"),
        (("--config", "no-such-config.json"), "no such file"),
        (("--config", LLAMA_70B, "--gpus", "4x"), "not understood"),
        (("--config", LLAMA_70B, "--gpus", "fourx80GiB"), "not understood"),
        (("--config", LLAMA_70B, "--gpus", "0x80GiB"), "0 GPUs"),
        (("--config", LLAMA_70B, "--gpus", "4x80G"), "ambiguous"),
        (("--config", LLAMA_70B, "--gpus", "3x80GiB"), "does not divide the model's 64 attention heads"),
        (("--config", LLAMA_70B, "--gpus", "4x80GiB", "--tp", "2"), "uses 2 GPUs"),
        (("--config", LLAMA_70B, "--gpus", "4x80GiB", "--pp", "3"), "does not divide the 4 GPUs"),
        (("--config", LLAMA_70B, "--gpus", "2x80GiB", "--gpu-memory", "80GiB"), "not both"),
        (("--config", LLAMA_70B, "--gpus", "1x80GiB", "--gpu-memory-utilization", "1.5"), "at most 1"),
        (("--config", LLAMA_70B, "--gpus", "1x80GiB", "--gpu-memory-utilization", "x"), "not a number"),
        (("--config", LLAMA_70B, "--tp", "4"), "give --gpus"),
        (("--config", LLAMA_70B, "--model", "m.gguf"), "not both"),
        (("--layers", "8", "--kv-heads", "8", "--gpus", "1x80GiB"), "needs the weights"),
        (("--config", LLAMA_70B, "--gpu-memory", "80GiB", "--pp", "81"), "more pipeline stages"),
        (("--config", LLAMA_70B, "--gpus", "1x80GiB", "--layers", "8"), "give --weights"),
    ],
)
def test_bad_deployment_input_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path, args, message):
    files = {
        "MALFORMED": '{"num_hidden_layers": 80,',
        "LIST": "[1, 2]",
        "NO_LAYERS": '{"num_attention_heads": 8}',
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    args = tuple(str(tmp_path / a) if a in files else a for a in args)
    code, out, err = run_main(monkeypatch, capsys, *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kv-memcalc: error: "), err
    assert message in err, err
