"""Familiar flags: -n/--max-tokens, model names (smollm2, gemma3), `--kv` that never swallows the prompt,
`--log-tokens=K`, --version and --quiet on every command, the kernel step's words, bin/fetch-model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferno.cli import common
from inferno.cli.generate import _optional_values, split_positionals
from inferno.errors import InfernoError

ROOT = Path(__file__).resolve().parents[1]


# -- `--kv` and `--log-tokens`: what takes a value -------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--kv", "Once upon a time", "8"], ["--kv=basic", "Once upon a time", "8"]),
        (["--kv"], ["--kv=basic"]),
        (["--kv", "--json", "hi"], ["--kv=basic", "--json", "hi"]),
        (["--kv", "paged", "hi"], ["--kv", "paged", "hi"]),
        (["--kv=window", "hi"], ["--kv=window", "hi"]),
        (["--kv", "pages", "hi"], ["--kv", "pages", "hi"]),  # a near miss: refused as a mode
        (["--kv", "Paged", "hi"], ["--kv=basic", "Paged", "hi"]),  # not lowercase: a prompt
        (["--log-tokens", "4"], ["--log-tokens=0", "4"]),  # the number stays MAX_NEW_TOKENS
        (["--log-tokens=3", "hi", "4"], ["--log-tokens=3", "hi", "4"]),
        (["hi", "--", "--kv"], ["hi", "--", "--kv"]),
    ],
)
def test_optional_values(argv, expected):
    assert _optional_values(argv) == expected


def test_model_names_are_recognised_as_the_model():
    assert split_positionals(("smollm2", "hi")) == ("smollm2", "hi", None)
    assert split_positionals(("gemma3", "hi", "5")) == ("gemma3", "hi", 5)
    assert split_positionals(("hi",)) == (None, "hi", None)


def test_model_names_resolve_to_the_fetched_files(model_path, tmp_path, monkeypatch):
    assert common.model_file("smollm2") == model_path
    assert common.model_file(None) == common.default_model()
    assert common.model_file("some/file.gguf") == Path("some/file.gguf")
    monkeypatch.setitem(common.MODEL_FILES, "gemma3", Path("models") / "absent.gguf")
    with pytest.raises(InfernoError, match=r"model gemma3 is not fetched: run `bin/fetch-model gemma3`"):
        common.model_file("gemma3")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3").write_bytes(b"")  # a file of that name wins: it is what was meant
    assert common.model_file("gemma3") == Path("gemma3")


# -- the commands, in this process with the session's engine ---------------------------------------


@pytest.fixture
def loads(monkeypatch, engine):
    """Engine.load hands back the session's engine and remembers what it was asked to load."""
    from inferno.runtime.engine import Engine

    paths = []

    def load(cls, path, progress=None):
        paths.append(Path(path))
        return engine

    monkeypatch.setattr(Engine, "load", classmethod(load))
    monkeypatch.setenv("NO_COLOR", "1")
    return paths


def generate(run_main, *args):
    from inferno.cli.generate import main

    return run_main(main, "model-generate", *args)


def test_max_tokens_flag(run_main, loads):
    code, out, err = generate(run_main, "--json", "-n", "3", "Once upon a time")
    assert code == 0, err
    assert json.loads(out)["metrics"]["generated_tokens"] == 3
    code, out, err = generate(run_main, "--json", "--max-tokens", "2", "Once upon a time", "2")
    assert code == 0, err
    code, out, err = generate(run_main, "-n", "3", "Once upon a time", "4")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "-n/--max-tokens 3 and MAX_NEW_TOKENS 4 differ" in err


def test_kv_alone_keeps_the_prompt(run_main, loads, engine):
    code, out, err = generate(run_main, "--json", "--kv", "Once upon a time", "3")
    assert code == 0, err
    record = json.loads(out)
    assert record["metrics"]["cache"] == "basic" and record["metrics"]["generated_tokens"] == 3
    assert record["prompt_ids"] == engine.tokenizer.encode("Once upon a time")
    code, out, err = generate(run_main, "--json", "--kv=paged", "Once upon a time", "3")
    assert code == 0 and json.loads(out)["metrics"]["cache"] == "paged"
    code, out, err = generate(run_main, "--kv", "pages", "hi")
    assert code == 2 and "unknown KV cache mode 'pages'" in err


def test_a_model_name_on_the_command_line(run_main, loads, model_path):
    code, _, err = generate(run_main, "--json", "smollm2", "Hello", "2")
    assert code == 0, err
    assert loads == [model_path]


def test_log_tokens_then_a_number_is_the_count(run_main, loads):
    code, out, err = generate(run_main, "--json", "--kv", "prealloc", "Hello", "--log-tokens", "2")
    assert code == 0, err
    record = json.loads(out)
    assert len(record["token_log"]) == 2 and record["token_log"][0]["top"] == []


def test_quiet_leaves_stderr_empty(run_main, loads):
    code, out, err = generate(run_main, "-q", "--kv", "prealloc", "Hello", "3")
    assert code == 0 and out.strip() and err == ""
    code, out, err = generate(run_main, "Hello", "3")
    assert code == 0 and "Metrics" in err


def test_quiet_kv_bench_and_inspect(run_main, loads):
    from inferno.cli.inspect import main as inspect_main
    from inferno.cli.kv_bench import main as bench_main

    code, out, err = run_main(bench_main, "kv-bench", "-q", "-n", "3", "--modes", "prealloc")
    assert code == 0 and "KV cache modes" in out and err == ""
    code, out, err = run_main(inspect_main, "kv-inspect", "--quiet", "smollm2", "Hello")
    assert code == 0 and "mean |K| per head" in out and err == ""


@pytest.mark.parametrize("module", ["generate", "chat", "memcalc", "inspect", "kv_bench", "perplexity",
                                    "serve"])
def test_version_on_every_command(run_main, module):
    import importlib

    main = importlib.import_module(f"inferno.cli.{module}").main
    from importlib.metadata import version

    code, out, err = run_main(main, "prog", "--version")
    assert code == 0 and err == ""
    name, number = out.split()
    assert number == version("inferno") and name.replace("-", "_").endswith(module.replace("kv_", ""))


def test_kv_perplexity_progress_free_json(run_main, loads, tmp_path):
    from inferno.cli.perplexity import main

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.")
    code, out, err = run_main(main, "kv-perplexity", "smollm2", "--text", text, "--window", "6", "--json")
    assert code == 0 and err == "", err
    assert [r["cache"] for r in json.loads(out)["runs"]] == ["prealloc", "window", "window"]
    code, out, err = run_main(main, "kv-perplexity", "-q", "--text", text, "--window", "6")
    assert code == 0 and err == "" and "perplexity" in out


# -- the start-up spinner's words ------------------------------------------------------------------


class Recorder:
    def __init__(self):
        self.said = []

    def status(self, message):
        from contextlib import nullcontext

        self.said.append(message)
        return nullcontext()


@pytest.mark.parametrize(("cached", "words"), [(True, "loading kernels"),
                                               (False, "compiling kernels (first run)"),
                                               (None, "loading or compiling kernels")])
def test_the_kernel_step_says_whether_it_compiles(monkeypatch, cached, words):
    monkeypatch.setattr(common, "kernels_cached", lambda: cached)
    console = Recorder()
    step = common.progress_on(console)
    with step("loading models/x.gguf"), step("compiling kernels (cached on disk after the first run)"):
        pass
    assert console.said == ["loading models/x.gguf", words]
    assert common.progress_on(None) is None


def test_kernels_cached_reads_numbas_index(engine):
    # the session's engine has loaded its kernels, so Numba's cache holds them now
    assert common.kernels_cached() in (True, None)


def test_kernels_cached_is_false_with_an_empty_cache_dir(tmp_path):
    code = ("import inferno.runtime.engine; from inferno.cli.common import kernels_cached; "
            "print(kernels_cached())")
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stderr


# -- bin/fetch-model ------------------------------------------------------------------------------


def test_fetch_model_knows_the_names_and_refuses_others():
    done = subprocess.run(["bash", str(ROOT / "bin" / "fetch-model"), "llama9"], capture_output=True,
                          text=True)
    assert done.returncode == 2
    assert done.stderr == "fetch-model: error: unknown model 'llama9' (known: smollm2, gemma3, qwen)\n"
    for name, path in common.MODEL_FILES.items():
        assert f"{path.name}" in (ROOT / "bin" / "fetch-model").read_text(), name
