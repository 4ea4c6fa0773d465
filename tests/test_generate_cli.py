"""model-generate as a user meets it: output, JSON, and one-line refusals of bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
from conftest import FIXTURES

from inferno.cli.generate import main

PROG = "model-generate"
TOKENIZER_FIXTURE = json.loads((FIXTURES / "tokenizer_smollm2.json").read_text(encoding="utf-8"))


@pytest.fixture
def generate(run_main):
    return lambda *args: run_main(main, PROG, *args)


def assert_refused(result, *fragments: str) -> None:
    code, out, err = result
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: "), err
    for fragment in fragments:
        assert fragment in lines[0]


def test_json_has_the_documented_keys(generate, model_path):
    code, out, err = generate("--kv", "prealloc", "--json", model_path, "Once upon a time", 5)
    assert code == 0, err
    report = json.loads(out)
    assert len(report["token_ids"]) == 5
    assert report["prompt_ids"] == [6403, 1980, 253, 655]
    assert isinstance(report["text"], str) and report["text"]
    m = report["metrics"]
    assert len(m["per_forward_ms"]) == 5  # one prefill + four decodes
    assert m["ttft_ms"] > 0 and m["decode_tok_s"] > 0
    assert (m["cache"], m["cache_capacity"]) == ("prealloc", 9)
    assert m["cache_bytes"] == 2 * 30 * 9 * 3 * 64 * 4


def test_json_splits_the_start_up_and_a_second_run_reads_the_prepared_model(generate, model_path,
                                                                           tmp_path, monkeypatch):
    monkeypatch.setenv("INFERNO_CACHE_DIR", str(tmp_path))
    runs = []
    for _ in range(2):
        code, out, err = generate("--kv", "prealloc", "--json", model_path, "Once upon a time", 3)
        assert code == 0, err
        runs.append(json.loads(out))
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    for run, cache in zip(runs, ("miss", "hit"), strict=True):
        m = run["metrics"]
        startup = m["startup"]
        assert startup["model_cache"] == cache
        parts = [startup[k] for k in ("open_ms", "weights_ms", "tokenizer_ms", "cache_write_ms")]
        assert all(p >= 0 for p in parts) and sum(parts) <= m["load_ms"]
        assert startup["kernels_ms"] == m["jit_ms"] > 0 and startup["imports_ms"] > 0
    writes = [run["metrics"]["startup"]["cache_write_ms"] for run in runs]
    assert writes[0] > 0 and writes[1] == 0


def test_text_output_streams_the_continuation_then_metrics(generate, model_path):
    code, out, err = generate("--kv", "--ignore-eos", model_path, "Once upon a time", 4)
    assert code == 0
    assert out.startswith(", the city")  # the continuation only: the prompt is not echoed into a pipe
    for label in ("Metrics", "time to first token", "decode", "per forward", "every forward"):
        assert label in err
    assert "basic" in err  # `--kv` alone means basic


def test_without_kv_there_is_no_cache(generate, model_path):
    code, out, _ = generate("--json", model_path, "Hello", 3)
    assert code == 0
    m = json.loads(out)["metrics"]
    assert m["cache"] is None and m["cache_bytes"] == 0


def test_missing_file(generate, tmp_path):
    assert_refused(generate(tmp_path / "nope.gguf", "hi"), "no such file")


def test_directory(generate, tmp_path):
    d = tmp_path / "dir.gguf"
    d.mkdir()
    assert_refused(generate(d, "hi"), "is a directory")


def test_empty_file(generate, tmp_path):
    f = tmp_path / "empty.gguf"
    f.write_bytes(b"")
    assert_refused(generate(f, "hi"), "empty")


def test_not_a_gguf(generate, tmp_path):
    f = tmp_path / "notes.gguf"
    f.write_text("just some text, not a model\n")
    assert_refused(generate(f, "hi"), "not a GGUF file")


@pytest.mark.parametrize("keep", [100, 3_000_000])  # cut in the header; cut in the tensor data
def test_truncated_gguf(generate, model_path, tmp_path, keep):
    f = tmp_path / "cut.gguf"
    with open(model_path, "rb") as src:
        f.write_bytes(src.read(keep))
    assert_refused(generate(f, "hi"), "truncated")


def write_tiny_gguf(path, arch: str = "llama", tensor_type=gguf.GGMLQuantizationType.F32) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(c) for c in range(33, 33 + 64)])
    w.add_token_types([1] * 64)
    w.add_token_merges([])
    shapes = {
        "token_embd.weight": (64, 32), "output_norm.weight": (32,), "blk.0.attn_norm.weight": (32,),
        "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (16, 32), "blk.0.attn_v.weight": (16, 32),
        "blk.0.attn_output.weight": (32, 32), "blk.0.ffn_norm.weight": (32,),
        "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64),
    }
    for name, shape in shapes.items():
        data = np.ones(shape, dtype=np.float32)
        if len(shape) == 2 and name.startswith("blk") and tensor_type != gguf.GGMLQuantizationType.F32:
            block, size = gguf.GGML_QUANT_SIZES[tensor_type]  # raw blocks: any bytes make a valid file
            blocks = np.zeros((shape[0], shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, blocks, raw_dtype=tensor_type)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture(generate, tmp_path):
    f = tmp_path / "mamba.gguf"
    write_tiny_gguf(f, arch="mamba")
    assert_refused(generate(f, "hi"), "unsupported architecture 'mamba'")


def test_unsupported_tensor_type(generate, tmp_path):
    f = tmp_path / "iq4.gguf"
    write_tiny_gguf(f, tensor_type=gguf.GGMLQuantizationType.IQ4_NL)
    assert_refused(generate(f, "hi"), "IQ4_NL")


def test_prompt_longer_than_the_context(generate, model_path):
    assert_refused(generate(model_path, "hello " * 8300, 1), "longer than the model's context of 8192")


def test_request_larger_than_the_cache_names_the_three_numbers(generate, model_path):
    assert_refused(generate("--kv", "prealloc", "--max-context", 6, model_path, "Once upon a time", 3),
                   "4 tokens", "3 new tokens", "--max-context 6")


def test_max_context_beyond_the_model(generate, model_path):
    assert_refused(generate("--kv", "prealloc", "--max-context", 9000, model_path, "hi", 3), "9000", "8192")


def test_without_cache_the_request_must_fit_the_context(generate, model_path):
    assert_refused(generate(model_path, "hello " * 8000, 500), "more than the model's context of 8192")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["hi", "0"], "at least 1"),
        (["hi", "--", "-3"], "at least 1"),
        (["hi", "-3"], "-3"),
        (["hi", "many"], "whole number"),
        (["--kv", "pages", "hi"], "unknown KV cache mode 'pages'"),
        (["--temperature", "-1", "hi"], "--temperature"),
        (["--top-p", "1.5", "hi"], "--top-p"),
        (["--top-k", "-2", "hi"], "--top-k"),
        (["--threads", "0", "hi"], "--threads"),
        (["--threads", "999", "hi"], "--threads"),
        (["--max-context", "0", "hi"], "--max-context"),
        (["--temperature", "warm", "hi"], "warm"),
        (["--frobnicate", "hi"], "--frobnicate"),
    ],
)
def test_bad_flags_and_counts(generate, model_path, args, fragment):
    assert_refused(generate(*args), fragment)


def test_a_real_process_prints_one_line_and_no_traceback(tmp_path):
    missing = tmp_path / "missing.gguf"
    done = subprocess.run([sys.executable, "-m", "inferno.cli.generate", str(missing), "hi"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr == f"{PROG}: error: {missing}: no such file\n"
    assert "Traceback" not in done.stderr


# -- sampling, --chat, --prompt-file: with the session's engine, not a load per run ---------------


@pytest.fixture
def generate_loaded(run_main, loaded_once):
    return lambda *args: json.loads(ok(run_main(main, PROG, "--json", *args)))


def ok(result) -> str:
    code, out, err = result
    assert code == 0, err
    return out


def test_sampling_with_a_seed_is_repeatable(generate_loaded):
    def ids(seed: int) -> list[int]:
        return generate_loaded("--temperature", "1.2", "--seed", seed, "Once upon a time", 6)["token_ids"]

    first = ids(7)
    assert ids(7) == first and ids(8) != first


def test_chat_applies_the_models_template(generate_loaded, engine):
    chat = TOKENIZER_FIXTURE["chats"][0]  # one user message, with the generation prompt
    assert len(chat["messages"]) == 1 and chat["add_generation_prompt"]
    report = generate_loaded("--chat", chat["messages"][0]["content"], 2)
    assert report["prompt"] == chat["rendered"]  # transformers' rendering of the same template
    ids = report["prompt_ids"]
    assert ids == engine.tokenizer.encode(chat["rendered"])
    # Each of the three turns (system, user, the assistant's to come) opens with <|im_start|>, one token.
    im_start = engine.tokenizer.encode("<|im_start|>")
    assert im_start == [1] and ids[0] == 1 and ids.count(1) == 3
    without = generate_loaded(chat["messages"][0]["content"], 2)
    assert without["prompt"] == chat["messages"][0]["content"] and 1 not in without["prompt_ids"]


def test_prompt_file_is_the_prompt(generate_loaded, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("Once upon a time", encoding="utf-8")
    from_file = generate_loaded("--prompt-file", path, 4)
    assert from_file["prompt_ids"] == [6403, 1980, 253, 655]  # transformers' ids of the text
    assert from_file["token_ids"] == generate_loaded("Once upon a time", 4)["token_ids"]
    text = "Line one,\n  line two: café ☕\n"
    path.write_text(text, encoding="utf-8")
    assert generate_loaded("--prompt-file", path, 1)["prompt"] == text  # newlines and all, as written


def test_prompt_file_problems_are_refused(generate, tmp_path):
    assert_refused(generate("--prompt-file", tmp_path / "none.txt", "3"), "cannot read --prompt-file")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    assert_refused(generate("--prompt-file", bad, "3"), "--prompt-file", "latin1.txt is not UTF-8 text")
    good = tmp_path / "p.txt"
    good.write_text("hi")
    assert_refused(generate("--prompt-file", good, "model.gguf", "hi", "3"), "too many arguments")
