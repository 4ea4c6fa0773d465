"""A hostile-input corpus, one group per input type: flags, prompt files, --save-cache paths, chat
templates, snapshots, kv-memcalc configs and the Python API. Each bad input is one line
`PROG: error: ...` with exit code 2 (Ctrl-C 130, SIGTERM 143), never a traceback, a hang or unbounded
memory. Most cases never load a model; those that do load the tiny fixture."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES

from inferno.cli import common, generate, inspect, memcalc
from inferno.errors import InfernoError

TINY = FIXTURES / "tiny_llama.gguf"  # context 256


def refused(result, prog: str, *fragments: str, code: int = 2) -> str:
    got, out, err = result
    assert got == code, (got, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def gen(run_main):
    return lambda *args: run_main(generate.main, "model-generate", *args)


@pytest.fixture
def calc(run_main):
    return lambda *args: run_main(memcalc.main, "kv-memcalc", *args)


def script(name: str) -> str:
    return str(Path(sys.executable).parent / name)


# -- flags --------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, fragments", [
    (("hi", "100000000000"), ("MAX_NEW_TOKENS 100,000,000,000", "16,777,216")),
    (("--num-samples", "1000000", "hi", "4"), ("--num-samples 1,000,000", "4,096")),
    (("--kv", "paged", "--block-size", "1000000000", "hi", "4"), ("--block-size 1,000,000,000", "of 256")),
    (("--max-context", "100000000000000000000", "hi", "4"), ("context of 256",)),
    (("--num-samples", "0", "hi", "4"), ("at least 1",)),
])  # fmt: skip
def test_flags_past_the_context_or_memory_are_one_line(gen, args, fragments):
    t = time.perf_counter()
    refused(gen(TINY, *args), "model-generate", *fragments)
    assert time.perf_counter() - t < 20


def test_num_samples_past_the_machines_memory_is_refused(gen, monkeypatch):
    monkeypatch.setattr(common, "physical_memory", lambda: 2**20)  # a 1 MiB machine
    line = refused(gen("--num-samples", "512", TINY, "hi", "8"), "model-generate", "--num-samples 512")
    assert "memory" in line


def test_start_up_interrupted_is_one_line_exit_130(gen, monkeypatch):
    from inferno.runtime.engine import Engine

    def interrupted(cls, path, progress=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "load", classmethod(interrupted))
    refused(gen(TINY, "hi", "2"), "model-generate", "interrupted", code=130)


def test_closed_stdout_is_one_line_not_a_traceback():
    for command in (f"{script('kv-memcalc')} --layers 2 --kv-heads 2",
                    f"{script('model-generate')} {TINY} hi 2"):  # fmt: skip
        done = subprocess.run(["bash", "-c", f"{command} >&-"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert done.stderr.strip().endswith("standard output is closed (`>&-`): redirect it to a file or "
                                            "/dev/null instead")


# -- prompt files -------------------------------------------------------------------------------


def test_a_fifo_nobody_writes_to_is_refused_at_once(gen, tmp_path):
    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)
    t = time.perf_counter()
    refused(gen("--prompt-file", fifo, TINY, "2"), "model-generate", "FIFO", "give a regular file, or -")
    assert time.perf_counter() - t < 5


def test_dev_zero_is_refused_quickly_without_reading_it(gen):
    t = time.perf_counter()
    refused(gen("--prompt-file", "/dev/zero", TINY, "2"), "model-generate", "is a character device")
    assert time.perf_counter() - t < 10


def test_a_huge_prompt_file_is_refused_without_reading_it(gen, tmp_path):
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as f:
        f.truncate(generate.PROMPT_FILE_LIMIT + 1)  # sparse: nothing is written or read
    refused(gen("--prompt-file", huge, TINY, "2"), "model-generate", "more than the 16 MiB")


def test_prompt_file_edge_cases(gen, tmp_path, monkeypatch):
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    refused(gen("--prompt-file", tmp_path / "latin1.txt", TINY, "2"), "model-generate", "not UTF-8")
    refused(gen("--prompt-file", tmp_path, TINY, "2"), "model-generate", "directory")
    monkeypatch.setattr(sys, "stdin", None)
    refused(gen("--prompt-file", "-", TINY, "2"), "model-generate", "standard input is closed")


def test_a_prompt_longer_than_the_context_is_refused_once_tokenized(gen, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("hello world " * 400)
    refused(gen("--kv", "prealloc", "--prompt-file", long, TINY, "2"), "model-generate", "context of 256")


# -- --save-cache paths -------------------------------------------------------------------------


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink", "dangling symlink", "device", "no dir"])
def test_save_cache_writes_only_regular_files_refused_before_the_run(gen, tmp_path, kind):
    target = tmp_path / "cache.st"
    elsewhere = tmp_path / "elsewhere.st"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "directory":
        target.mkdir()
    elif kind == "symlink":
        elsewhere.write_bytes(b"keep me")
        target.symlink_to(elsewhere)
    elif kind == "dangling symlink":
        target.symlink_to(elsewhere)
    elif kind == "device":
        target = Path("/dev/null")
    else:
        target = tmp_path / "absent" / "cache.st"
    before = _listing(tmp_path)
    line = refused(gen("--save-cache", target, TINY, "hi", "2"), "model-generate")
    assert {"symlink": "symbolic link", "dangling symlink": "symbolic link", "fifo": "FIFO",
            "device": "character device", "no dir": "no directory",
            "directory": "directory"}[kind] in line  # fmt: skip
    assert _listing(tmp_path) == before  # nothing created, replaced or left behind
    if kind == "symlink":
        assert elsewhere.read_bytes() == b"keep me"


def test_an_interrupted_save_leaves_nothing_and_sigterm_exits_143(gen, tmp_path, monkeypatch):
    from inferno.kv import snapshot

    def killed(*args, **kwargs):
        raise common.Terminated  # what the SIGTERM handler raises, here in the middle of the write

    target = tmp_path / "cache.st"
    monkeypatch.setattr(snapshot, "save", lambda tensors, metadata: b"x" * 1000)
    monkeypatch.setattr(os, "replace", killed)
    refused(gen("--save-cache", target, TINY, "hi", "2"), "model-generate", "terminated", code=143)
    assert _listing(tmp_path) == []


def test_sigterm_during_a_run_exits_143_without_a_traceback(tmp_path):
    target = tmp_path / "cache.st"
    run = subprocess.Popen([script("model-generate"), "--kv", "window", "--window", "8", "--ignore-eos",
                            "--save-cache", str(target), str(TINY), "hi", "1000000"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    run.stdout.read(1)  # generating
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 143, err
    assert b"Traceback" not in err
    assert _listing(tmp_path) == []  # an interrupted run saves nothing


# -- chat templates -----------------------------------------------------------------------------

TEMPLATES = {
    "syntax error": ("{% for %}", "TemplateSyntaxError"),
    "raise_exception": ("{{ raise_exception('no system role') }}", "no system role"),
    "include": ("{% include 'x.j2' %}", "no loader"),
    "import": ("{% import 'x.j2' as x %}", "no loader"),
    "extends": ("{% extends 'base' %}", "no loader"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    "huge range": ("{% for i in range(10**9) %}{% endfor %}", "OverflowError"),
    "int to str": ("{{ (10 ** 5000) | string }}", "ValueError"),
    "huge power": ("{{ 2 ** 100000000 }}", "too large a number"),
    "repeat": ("{{ 'x' * 10**9 }}", "repeating a sequence"),
    "str.format width": ("{{ '{:>999999999}'.format(1) }}", "'format' of 'str' object is unsafe"),
    "format_map": ("{{ '{x}'.format_map({}) }}", "unsafe"),
    "%-width": ("{{ '%999999999d' % 1 }}", "wider than"),
    "format filter": ("{{ '%999999999d' | format(1) }}", "wider than"),
    "center": ("{{ 'x'.center(999999999) }}", "wider than"),
    "center filter": ("{{ 'x' | center(999999999) }}", "wider than"),
    "replace blow-up": ("{{ ('x' * 100000).replace('', 'y' * 100) }}", "replace would pass"),
    "join blow-up": ("{{ range(100000) | join('x' * 100) }}", "join would pass"),
    "~ doubling": ("{% set ns = namespace(x='ab') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}"
                   "{% endfor %}{{ ns.x }}", "joining with ~"),
    "long output": ("{% for i in range(100000) %}{{ 'abcdefghijklmnopqrstuvwxyz' }}{% endfor %}",
                    "output is more than"),
    "lone surrogate": ("{{ '\\ud800' }}", "lone surrogate"),
    "undefined call": ("{{ foo() }}", "UndefinedError"),
    "division by zero": ("{{ 1 // 0 }}", "ZeroDivisionError"),
}


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_hostile_chat_template_is_one_line_naming_its_source(name):
    from inferno.text.chat_template import render

    template, fragment = TEMPLATES[name]
    t = time.perf_counter()
    with pytest.raises(InfernoError) as bad:
        render(template, template_source="--chat-template evil.jinja",
               messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    message = str(bad.value)
    assert message.startswith("--chat-template evil.jinja failed: ") and "\n" not in message
    assert fragment in message
    assert time.perf_counter() - t < 3


def test_a_chat_template_that_never_ends_is_stopped(monkeypatch):
    from inferno.text import chat_template

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.3)
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    t = time.perf_counter()
    with pytest.raises(InfernoError, match=r"ran for more than 0\.3 s"):
        chat_template.render(loops, messages=[])
    assert time.perf_counter() - t < 3


def test_ordinary_templates_still_render():
    from inferno.text.chat_template import render

    text = render("{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}{{ '%d' % loop.index }}"
                  "{% endfor %}{{ ['a', 'b'] | join(', ') }}{{ 'x' ~ 1 }}{{ 'x'.center(5) }}",
                  messages=[{"role": "user", "content": " hi "}])
    assert text == "<|user|>hi1a, bx1  x  "


# -- snapshots ----------------------------------------------------------------------------------


def _snapshot(tmp_path: Path, bad: float) -> Path:
    from inferno.kv import KVGeometry
    from inferno.kv.snapshot import Snapshot

    geometry = KVGeometry(layers=2, kv_heads=2, heads=4, head_dim=16)
    keys = np.zeros((2, 3, 32), np.float32)
    keys[1, 2, 5] = bad
    snapshot = Snapshot(keys, np.zeros_like(keys), np.arange(3, dtype=np.int32), "llama", geometry, "0" * 64)
    path = tmp_path / f"{bad}.st"
    snapshot.save(path)
    return path


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_snapshot_with_non_finite_rows_is_refused(run_main, tmp_path, bad):
    path = _snapshot(tmp_path, bad)
    refused(run_main(inspect.main, "kv-inspect", path), "kv-inspect",
            "keys of layer 1 at position 2 hold NaN or infinity")  # fmt: skip


def test_snapshot_save_refuses_a_symlink_through_the_api(tmp_path):
    from inferno.kv.snapshot import check_save_path

    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(InfernoError, match="symbolic link"):
        check_save_path(tmp_path / "link")
    check_save_path(tmp_path / "new.st")  # absent in a writable directory: fine


# -- kv-memcalc configs -------------------------------------------------------------------------

BASE = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000, "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16"}  # fmt: skip
CONFIGS = {
    "deep arrays": ("[" * 100_000 + "]" * 100_000, "nests arrays or objects too deeply"),
    "deep objects": ('{"a":' * 50_000 + "1" + "}" * 50_000, "nests arrays or objects too deeply"),
    "5,000 digits": (json.dumps(BASE).replace('"num_hidden_layers": 4', '"num_hidden_layers": ' + "9" * 5000),
                     "a number too long"),
    "too many layers": (json.dumps({**BASE, "num_hidden_layers": 10**7}), "must be at most 100,000"),
    "a huge count": (json.dumps({**BASE, "hidden_size": 10**300}), "hidden_size is too large"),
    "dict torch_dtype": (json.dumps({**BASE, "torch_dtype": {"a": 1}}), "torch_dtype {'a': 1} is not one of"),
    "list torch_dtype": (json.dumps({**BASE, "torch_dtype": ["x"]}), "is not one of"),
    "surrogate model_type": (json.dumps(BASE).replace('"llama"', '"\\ud800"'), "lone surrogate"),
    "dict model_type": (json.dumps({**BASE, "model_type": {"x": 1}, "sliding_window": 8}), "a string"),
    "infinite number": (json.dumps(BASE).replace("512", "1e400"), "hidden_size must be a whole number"),
}  # fmt: skip


@pytest.mark.parametrize("name", CONFIGS)
def test_a_hostile_config_is_one_line(calc, tmp_path, name):
    text, fragment = CONFIGS[name]
    config = tmp_path / "config.json"
    config.write_text(text)
    refused(calc("--config", config), "kv-memcalc", fragment)


def test_a_fifo_config_is_refused(calc, tmp_path):
    os.mkfifo(tmp_path / "config.json")
    refused(calc("--config", tmp_path / "config.json"), "kv-memcalc", "not a regular file")


def test_gpus_without_a_unit_and_plans_that_do_not_fit(calc, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(BASE))
    refused(calc("--config", config, "--gpus", "4x80"), "kv-memcalc", "no unit", "80GiB")
    refused(calc("--config", config, "--gpu-memory", "80", "--tp", "1"), "kv-memcalc", "no unit")
    refused(calc("--config", config, "--gpus", "1x1MiB", "--context", "4k"), "kv-memcalc", "does not fit")


def test_the_longest_context_is_capped_at_the_models(calc, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(BASE))
    code, out, _ = calc("--config", config, "--budget", "80GiB", "--json")
    report = json.loads(out)
    assert code == 0 and report["max_context"] == 4096 and report["max_context_budget"] > 4096
    code, out, _ = calc("--config", config, "--gpus", "1x80GiB", "--json")
    assert json.loads(out)["deployment"]["per_gpu"]["max_context"] == 4096


# -- the Python API -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from inferno.runtime.engine import load

    return load(TINY)


def test_load_refuses_what_is_not_a_path():
    from inferno.runtime.engine import load

    for bad in (None, 3, "", b"model.gguf"):
        with pytest.raises(InfernoError, match="path must be a path"):
            load(bad)


@pytest.mark.parametrize("call, fragment", [
    (lambda e: e.generate("hi", "3"), "max_new_tokens must be an integer, got str '3'"),
    (lambda e: e.generate("hi", 0), "max_new_tokens must be at least 1, got 0"),
    (lambda e: e.generate("hi", True), "max_new_tokens must be an integer, got bool"),
    (lambda e: e.generate(3, 2), "prompt must be a str"),
    (lambda e: e.generate("hi", 2, chat="yes"), "chat must be True or False"),
    (lambda e: list(e.stream(b"hi", 2)), "prompt must be a str"),
    (lambda e: e.run([1, 2.0], 3), "prompt_ids[1] must be an integer token id"),
    (lambda e: e.run([], 3), "prompt_ids is empty"),
    (lambda e: e.run([10**9], 3), "outside the vocabulary"),
    (lambda e: e.make_cache("paged", 3, 2, block_size=0), "block_size must be at least 1, got 0"),
    (lambda e: e.make_cache("prealloc", "3", 2), "prompt_tokens must be an integer"),
    (lambda e: e.make_cache("zzz", 3, 2), "layout 'zzz' is not one of"),
    (lambda e: e.make_cache("window", 3, 2, window=-1), "window must be at least 1"),
])  # fmt: skip
def test_the_api_names_the_bad_argument(tiny, call, fragment):
    with pytest.raises(InfernoError) as bad:
        call(tiny)
    assert fragment in str(bad.value)
    assert "KV cache is full" not in str(bad.value)


def test_kv_make_cache_checks_its_arguments(tiny):
    from inferno.kv import make_cache

    geometry = tiny.config.kv_geometry
    with pytest.raises(InfernoError, match="block_size must be at least 1"):
        make_cache("paged", geometry, 8, block_size=0)
    with pytest.raises(InfernoError, match="capacity must be an integer"):
        make_cache("prealloc", geometry, 8.0)
    with pytest.raises(InfernoError, match="unknown KV cache layout"):
        make_cache(None, geometry, 8)


# -- found by tests/hostile_fuzz.py -------------------------------------------------------------


@pytest.mark.parametrize("change, fragment", [
    ({"shared_expert_intermediate_size": [""], "num_experts": 4}, "shared_expert_intermediate_size must be"),
    ({"vocab_size": "1000"}, "vocab_size must be a whole number"),
    ({"intermediate_size": 1.5}, "intermediate_size must be a whole number"),
    ({"tie_word_embeddings": [1]}, "tie_word_embeddings must be true or false"),
])  # fmt: skip
def test_config_counts_of_the_parameter_estimate_are_checked(calc, tmp_path, change, fragment):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**BASE, **change}))
    refused(calc("--config", config), "kv-memcalc", fragment)


@pytest.mark.parametrize("line, fragment", [
    ('{"prompt": "hi", "max_new_tokens": 100000000000000000000}', "line 1: max_new_tokens must be from 1 to"),
    ('{"prompt": "hi", "max_new_tokens": 16000000}', "context of 256"),  # was ENOMEM allocating the pool
    ('{"prompt": "hi", "seed": -1}', "line 1: seed must be 0 or more"),
    ('{"prompt": "hi", "top_p": 0}', "line 1: top_p must be in (0, 1]"),
    ('{"prompt": "hi", "top_k": -3}', "line 1: top_k must be 0 (off) or more"),
    ('{"prompt": "hi", "temperature": 1e-9}', "line 1: temperature must be 0 (greedy) or from"),
    ('{"prompt": "hi", "seed": 1' + "0" * 5000 + "}", "line 1: holds a number too long to read"),
    ('{"prompt": "hi", "temperature": 1' + "0" * 400 + "}", "temperature is past what a float holds"),
])  # fmt: skip
def test_batch_line_numbers_out_of_range_name_the_line(gen, tmp_path, line, fragment):
    batch = tmp_path / "b.jsonl"
    batch.write_text(line + "\n")
    refused(gen(TINY, "--batch", batch, "-n", "2"), "model-generate", fragment)


def test_a_batch_of_more_prompts_than_a_run_takes_is_refused(tmp_path):
    from inferno.cli.generate_many import MAX_BATCH_PROMPTS, Defaults, read_batch

    batch = tmp_path / "b.txt"
    batch.write_text("hi\n" * (MAX_BATCH_PROMPTS + 1))
    with pytest.raises(InfernoError, match="holds 65,537 lines, more than the 65,536 prompts a run takes"):
        read_batch(str(batch), Defaults(2, 0.0, 0, 1.0, None, False, False))


def test_batch_lines_end_at_newlines_and_a_bom_is_not_text(tmp_path):
    from inferno.cli.generate_many import Defaults, read_batch

    batch = tmp_path / "b.jsonl"
    batch.write_bytes(b'\xef\xbb\xbf{"prompt": "a\xe2\x80\xa8b", "seed": 3}\r\n{"prompt": "c"}\n')
    entries = read_batch(str(batch), Defaults(2, 0.0, 0, 1.0, None, False, False))
    assert [(e["prompt"], e["seed"]) for e in entries] == [("a\u2028b", 3), ("c", None)]


@pytest.mark.parametrize("flag", ["model", "--batch", "--chat-template", "--prompt-file"])
def test_a_fifo_or_device_where_a_file_is_read_is_refused_before_opening_it(gen, tmp_path, flag):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    args = {"model": (fifo, "hi", "2"), "--batch": ("--batch", fifo, TINY),
            "--chat-template": ("--chat", "--chat-template", fifo, TINY, "hi", "2"),
            "--prompt-file": ("--prompt-file", fifo, TINY, "2")}[flag]  # fmt: skip
    t = time.perf_counter()
    refused(gen(*args), "model-generate", "FIFO")
    refused(gen(*[a if a != fifo else "/dev/zero" for a in args]), "model-generate", "character device")
    assert time.perf_counter() - t < 10


def test_other_commands_refuse_a_fifo_for_a_file(run_main, tmp_path):
    from inferno.cli import perplexity

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused(run_main(inspect.main, "kv-inspect", fifo), "kv-inspect", "FIFO", "a snapshot is a regular file")
    refused(run_main(memcalc.main, "kv-memcalc", "--model", fifo), "kv-memcalc", "FIFO")
    refused(run_main(perplexity.main, "kv-perplexity", TINY, "--text", fifo, "--window", "8"),
            "kv-perplexity", "--text", "FIFO")  # fmt: skip


def test_perplexity_window_and_sinks_are_checked_before_the_model_loads(run_main, tmp_path, monkeypatch):
    from inferno.cli import perplexity
    from inferno.runtime.engine import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("loaded the model")))
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time")
    refused(run_main(perplexity.main, "kv-perplexity", TINY, "--text", text, "--window", "0"),
            "kv-perplexity", "--window must be at least 1")  # fmt: skip
    refused(run_main(perplexity.main, "kv-perplexity", TINY, "--text", text, "--window", "4", "--sinks", "4"),
            "kv-perplexity", "--sinks must be from 0 to fewer than --window 4")  # fmt: skip


def test_a_prompt_far_past_the_context_is_refused_before_it_is_tokenized(tiny, monkeypatch):
    calls = []
    inner = tiny.tokenizer._tokenizer
    monkeypatch.setattr(tiny.tokenizer, "_tokenizer", type("T", (), {
        "encode": lambda self, text, **k: calls.append(len(text)) or inner.encode(text, **k)})())  # fmt: skip
    with pytest.raises(InfernoError, match=r"is at least .* tokens, longer than the model's context of 256"):
        tiny.tokenizer.encode("hello world " * 1_000_000, 256)  # 12 MB: by its bytes, never tokenized
    with pytest.raises(InfernoError, match="context of 256"):
        tiny.tokenizer.encode("x" * 3000, 256)  # counted a piece of 1,024 characters at a time
    assert max(calls) <= 1024
    assert tiny.tokenizer.encode("hello world", 256) == inner.encode("hello world").ids


def test_a_chat_template_rendering_nothing_is_refused_by_model_chat(run_main, tmp_path, monkeypatch):
    import io

    from inferno.cli import chat

    template = tmp_path / "t.jinja"
    template.write_text("{{ none.attr }}")  # renders as ""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    refused(run_main(chat.main, "model-chat", TINY, "--chat-template", template), "model-chat",
            "renders a user message as no tokens")  # fmt: skip


def test_serve_cache_memory_past_the_machine_and_unmappable_buffers(run_main, monkeypatch):
    import errno
    import mmap

    from inferno.cli import serve
    from inferno.kv import memory

    refused(run_main(serve.main, "model-serve", TINY, "--block-size", "100000", "--port", "0"), "model-serve",
            "--block-size 100,000 is more than the model's context of 256")  # fmt: skip
    monkeypatch.setattr(serve, "physical_memory", lambda: 2**30)
    refused(run_main(serve.main, "model-serve", TINY, "--cache-memory", "2GiB", "--port", "0"), "model-serve",
            "--cache-memory 2GiB is more than this machine's 1.0 GiB")  # fmt: skip
    with pytest.raises(InfernoError, match=r"cannot reserve .* GiB for the KV cache: too large"):
        memory.lazy_zeros((2**70,))

    def no_memory(*args):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_memory)
    with pytest.raises(InfernoError, match="cannot allocate memory"):
        memory.lazy_zeros((4, 4))


def test_a_refusal_after_a_threads_note_is_still_one_line(monkeypatch, capsys):
    import click

    @click.command()
    def noted():
        common.note("other processes kept 1.0 CPUs busy")
        raise InfernoError("bad input")

    monkeypatch.setattr(sys, "argv", ["prog"])
    with pytest.raises(SystemExit):
        common.run(noted, "prog")
    assert capsys.readouterr().err == "prog: error: bad input\n"

    @click.command()
    def fine():
        common.note("other processes kept 1.0 CPUs busy")

    common.run(fine, "prog")
    assert capsys.readouterr().err == "note: other processes kept 1.0 CPUs busy\n"


def test_a_snapshot_declaring_gigabytes_it_does_not_hold_is_refused_unread(run_main, tmp_path):
    import struct

    good = _snapshot(tmp_path, 0.0).read_bytes()
    n = struct.unpack("<Q", good[:8])[0]
    header = json.loads(good[8:8 + n])
    tokens = 2**22  # 2 x 2 layers x 4M tokens x 32 floats: 2 GiB of rows
    rows = 2 * tokens * 32 * 4
    header |= {"keys": {"dtype": "F32", "shape": [2, tokens, 32], "data_offsets": [0, rows]},
               "values": {"dtype": "F32", "shape": [2, tokens, 32], "data_offsets": [rows, 2 * rows]},
               "token_ids": {"dtype": "I32", "shape": [tokens],
                             "data_offsets": [2 * rows, 2 * rows + 4 * tokens]}}  # fmt: skip
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    sparse = tmp_path / "sparse.safetensors"
    with sparse.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + 2 * rows + 4 * tokens)  # nothing written: no disk, no memory
    t = time.perf_counter()
    refused(run_main(inspect.main, "kv-inspect", sparse), "kv-inspect", "declares 2.0 GiB of rows")
    assert time.perf_counter() - t < 3


def test_serve_refuses_a_host_name_idna_cannot_encode(run_main):
    from inferno.cli import serve

    for host in ("a" * 100, "x..y", "\udc80"):
        refused(run_main(serve.main, "model-serve", TINY, "--host", host, "--port", "0"), "model-serve",
                "is not a valid host name or address")  # fmt: skip


def test_a_file_name_too_long_is_one_short_line(gen, calc, run_main):
    name = "x" * 5000 + ".gguf"
    line = refused(gen(name, "hi", "2"), "model-generate", "File name too long", "(5,005 characters)")
    assert len(line) < 300
    refused(calc("--config", name), "kv-memcalc", "File name too long")
    refused(run_main(inspect.main, "kv-inspect", name[:-5] + ".safetensors"), "kv-inspect", "no such file")
    refused(gen("--save-cache", name, TINY, "hi", "2"), "model-generate", "File name too long")


def test_model_chat_stops_at_a_line_that_never_ends(run_main, monkeypatch, tmp_path):
    import io

    from inferno.cli import chat

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    monkeypatch.setattr(chat, "MAX_LINE", 1000)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\x00" * 5000))
    refused(run_main(chat.main, "model-chat", TINY, "--chat-template", template), "model-chat",
            "a line of standard input is more than the")  # fmt: skip


def test_a_loop_of_symlinks_for_the_model_is_one_line(gen, tmp_path):
    loop = tmp_path / "loop.gguf"
    loop.symlink_to(loop)
    refused(gen(loop, "hi", "2"), "model-generate", "Too many levels of symbolic links")
    refused(gen("--save-cache", loop, "--load-cache", loop, TINY, "hi", "2"), "model-generate",
            "--save-cache names the --load-cache file")  # fmt: skip


def test_serve_refuses_a_surrogate_or_huge_prompt_with_a_400(tiny):
    from inferno.serve.app import ServeConfig, encode_prompt
    from inferno.serve.protocol import APIError

    config = ServeConfig("tiny", 256, tiny.config.vocab_size)
    with pytest.raises(APIError) as bad:
        encode_prompt(tiny.tokenizer, config, "a\ud800", "prompt")  # was a 500 (TypeError in tokenizers)
    assert bad.value.status == 400 and "lone surrogate at character 1" in bad.value.message
    t = time.perf_counter()
    with pytest.raises(APIError) as bad:
        encode_prompt(tiny.tokenizer, config, "x" * 50_000_000, "prompt")  # was 8 GB and minutes
    assert bad.value.code == "context_length_exceeded" and time.perf_counter() - t < 2
    assert encode_prompt(tiny.tokenizer, config, "hi", "prompt") == tiny.tokenizer.encode("hi")


def test_serve_refuses_a_body_nested_too_deeply_with_a_400():
    from inferno.serve.protocol import APIError, CompletionRequest, parse

    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001):
        with pytest.raises(APIError) as bad:
            parse(CompletionRequest, raw)  # was a 500 (RecursionError)
        assert bad.value.status == 400 and "nests arrays or objects too deeply" in bad.value.message
