"""model-generate --num-samples and --batch: many sequences, one model load, shared prompt blocks."""

from __future__ import annotations

import json

import pytest

from inferno.cli.generate import main

PROG = "model-generate"
PREFIX = "You are a helpful assistant who answers in one short sentence. " * 3  # 40 tokens


@pytest.fixture
def generate(run_main):
    return lambda *args: run_main(main, PROG, *args)


def test_each_sample_is_what_its_seed_gives_alone_and_the_prompt_is_held_once(generate, model_path):
    code, out, err = generate("--num-samples", 3, "--temperature", 0.9, "--seed", 5, "--ignore-eos", "--json",
                              model_path, PREFIX, 6)
    assert code == 0, err
    report = json.loads(out)
    assert [s["seed"] for s in report["samples"]] == [5, 6, 7]
    for sample in report["samples"][1:]:
        code, out, err = generate("--kv", "paged", "--temperature", 0.9, "--seed", sample["seed"],
                                  "--ignore-eos", "--json", model_path, PREFIX, 6)
        assert json.loads(out)["token_ids"] == sample["token_ids"]
    m = report["metrics"]
    block = 16 * 30 * 2 * 192 * 4
    prompt = len(report["prompt_ids"])
    full = (prompt - 1) // 16  # the full blocks before the prompt's last token: computed once, shared
    assert m["reused_tokens"] == 2 * 16 * full
    own = -(-(prompt + 2) // 16) - full  # each sample's own blocks once all decode (two tokens in)
    assert m["start_cache_bytes"] == (full + 3 * own) * block
    assert m["unshared_prompt_bytes"] == 3 * prompt * block // 16
    assert m["preemptions"] == 0


def test_batch_reuses_the_blocks_of_a_shared_prefix(generate, model_path, tmp_path):
    batch = tmp_path / "prompts.txt"
    questions = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?"]
    batch.write_text("\n".join(PREFIX + q for q in questions[:2])
                     + "\n" + json.dumps({"prompt": PREFIX + questions[2], "max_new_tokens": 3}) + "\n")
    code, out, err = generate("--batch", batch, "--ignore-eos", "--json", model_path, 5)
    assert code == 0, err
    *rows, summary = [json.loads(line) for line in out.splitlines()]
    assert [r["reused_tokens"] for r in rows] == [0, 32, 32]  # two full 16-token blocks of the prefix
    assert [len(r["token_ids"]) for r in rows] == [5, 5, 3]
    alone = PREFIX + questions[1]
    code, out, err = generate("--json", "--kv", "prealloc", "--ignore-eos", model_path, alone, 5)
    assert json.loads(out)["token_ids"] == rows[1]["token_ids"]  # reused blocks change nothing
    assert summary["summary"]["reused_tokens"] == 64 and summary["summary"]["prompts"] == 3


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--num-samples", "0", "hi"), "--num-samples must be at least 1"),
        (("--num-samples", "2", "--log-tokens", "hi"), "--log-tokens logs one sequence"),
        (("--num-samples", "2", "--max-context", "64", "hi"), "for one sequence"),
    ],
)
def test_bad_many_sequence_flags_are_refused(generate, args, fragment):
    code, _, err = generate(*args)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1


def test_a_bad_batch_line_is_refused_naming_it(generate, model_path, tmp_path):
    batch = tmp_path / "prompts.txt"
    batch.write_text('hello\n{"prompt": "x", "colour": 1}\n')
    code, out, err = generate("--batch", batch, model_path)
    assert code == 2 and "line 2" in err and "colour" in err and out == ""


def test_stop_strings_and_end_tokens_end_every_sequence(generate, model_path, tmp_path):
    """--stop and a line's "stop" cut the text before it; a chat reply never shows its end-of-turn token."""
    batch = tmp_path / "prompts.jsonl"
    batch.write_text(json.dumps({"prompt": "The capital of France is Paris. The capital of Italy is",
                                 "stop": "."}) + "\n" + json.dumps({"prompt": "Once upon a time"}) + "\n")
    code, out, err = generate("--batch", batch, "--stop", "the", "--json", model_path, 24)
    assert code == 0, err
    first, second, _ = [json.loads(line) for line in out.splitlines()]
    assert first["stopped_by"] == "." and first["finish_reason"] == "stop" and "." not in first["text"]
    assert second["stopped_by"] == "the" and "the" not in second["text"]
    code, out, err = generate("--num-samples", 2, "--chat", "--json", model_path, "Say hello.", 40)
    assert code == 0, err
    for sample in json.loads(out)["samples"]:
        assert sample["finish_reason"] == "stop" and "<|im_end|>" not in sample["text"]


BAD_LINES = ['{"prompt": "x", "temperature": "hot"}', '{"prompt": "x", "seed": null, "top_k": 1.5}',
             '{"prompt": "x", "stop": [1]}', '{"prompt": "x", "max_new_tokens": true}',
             '{"prompt": "x", "top_p": 1e999}', '{"prompt": "\\ud800"}']


@pytest.mark.parametrize("line", BAD_LINES)
def test_a_batch_line_of_the_wrong_type_is_refused_in_one_line(generate, model_path, tmp_path, line):
    batch = tmp_path / "prompts.jsonl"
    batch.write_text(line + "\n")
    code, out, err = generate("--batch", batch, model_path)
    assert code == 2 and "line 1" in err and len(err.strip().splitlines()) == 1 and out == ""


def test_samples_run_in_any_layout(generate, model_path):
    code, out, err = generate("--num-samples", 2, "--kv", "prealloc", "--kv-dtype", "q8_0", "--json",
                              model_path, "Once upon a time", 4)
    assert code == 0, err
    samples = json.loads(out)["samples"]
    code, out, err = generate("--kv", "prealloc", "--kv-dtype", "q8_0", "--json", model_path,
                              "Once upon a time", 4)
    assert samples[0]["token_ids"] == samples[1]["token_ids"] == json.loads(out)["token_ids"]
