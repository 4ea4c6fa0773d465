"""The command line's edges: literal prompts, Ctrl-C, broken pipes, stdout holding only the text,
stop strings and the chat end token, and every bad value refused in one line with exit code 2."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES

from inferno.cli import generate, inspect, kv_bench, memcalc
from inferno.model.sampling import Sampler

TINY = FIXTURES / "tiny_llama.gguf"


@pytest.fixture
def gen(run_main):
    return lambda *args: run_main(generate.main, "model-generate", *args)


def assert_refused(result, prog: str, *fragments: str) -> None:
    code, out, err = result
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    for fragment in fragments:
        assert fragment in lines[0]


def command(name: str) -> list[str]:
    """The installed console script, beside the interpreter running the tests (the venv's bin/)."""
    return [str(Path(sys.executable).parent / name)]


# -- what a script captures ---------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["Explain a[/i] in Python", "Use [bold] tags", "[red]:smile:"])
def test_prompt_is_echoed_literally_never_as_markup(gen, monkeypatch, prompt):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # the echo is for someone watching
    code, out, err = gen(TINY, prompt, 2)
    assert code == 0, err
    assert err.startswith(prompt)
    assert prompt not in out


def test_stdout_holds_only_the_generated_text(gen):
    code, out, err = gen("--ignore-eos", TINY, "Hello world", 4)
    assert code == 0, err
    code, js, _ = gen("--json", "--ignore-eos", TINY, "Hello world", 4)
    assert out == json.loads(js)["text"] + "\n"
    assert "Metrics" in err and "Hello world" not in err + out


def test_prompt_file_dash_reads_standard_input(gen, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello \xc3\xa9")))
    code, out, _ = gen("--json", "--prompt-file", "-", TINY, 2)
    assert code == 0
    assert json.loads(out)["prompt"] == "Hello é"


def test_a_file_named_like_the_prompt_is_not_taken_for_the_model(gen, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    Path("hello").write_text("not a model\n")
    monkeypatch.setenv("INFERNO_MODEL", str(TINY))
    code, out, err = gen("--json", "hello", 2)
    assert code == 0, err
    assert json.loads(out)["prompt"] == "hello"


def test_max_context_without_kv_means_prealloc(gen):
    code, out, _ = gen("--json", "--max-context", 20, TINY, "Hello", 2)
    assert code == 0
    metrics = json.loads(out)["metrics"]
    assert (metrics["cache"], metrics["cache_capacity"]) == ("prealloc", 20)


@pytest.mark.parametrize("cli", [generate, memcalc, inspect, kv_bench])
def test_every_command_has_version(run_main, cli):
    code, out, _ = run_main(cli.main, cli.PROG, "--version")
    assert code == 0 and out.startswith(f"{cli.PROG} ") and out.strip().split()[-1][0].isdigit()


# -- stop strings, the end token, the system message ---------------------------------------------


def test_chat_end_token_is_in_neither_text_nor_json(gen, model_path, engine):
    _, out, _ = gen("--json", "--kv", "--chat", model_path, "What is the capital of France?", 16)
    run = json.loads(out)
    end = engine.tokenizer.encode("<|im_end|>")
    assert (run["finish_reason"], run["stopped_by"]) == ("stop", "<|im_end|>")
    assert "<|im_end|>" not in run["text"] and "Paris" in run["text"]
    assert end[0] not in run["token_ids"]
    _, text, _ = gen("--kv", "--chat", model_path, "What is the capital of France?", 16)
    assert text == run["text"] + "\n"


def test_system_message_goes_into_the_chat_template(gen, model_path):
    code, out, _ = gen("--json", "--kv", "--chat", "--system", "Answer in French.", model_path, "Hi", 1)
    assert code == 0
    prompt = json.loads(out)["prompt"]
    assert prompt.startswith("<|im_start|>system\nAnswer in French.<|im_end|>")


def test_stop_string_ends_generation_and_trims_the_text(gen, model_path):
    _, full, _ = gen("--json", "--kv", model_path, "Once upon a time", 12)
    full_text = json.loads(full)["text"]
    assert " city of Nova" in full_text  # the stop string spans several tokens
    _, out, _ = gen("--json", "--kv", "--stop", "Nova", "--stop", "never appears", model_path,
                    "Once upon a time", 12)
    run = json.loads(out)
    assert (run["finish_reason"], run["stopped_by"]) == ("stop", "Nova")
    assert run["text"] == full_text[: full_text.index("Nova")]
    assert len(run["token_ids"]) < 12
    _, streamed, _ = gen("--kv", "--stop", "Nova", model_path, "Once upon a time", 12)
    assert streamed == run["text"] + "\n"


def test_engine_stream_holds_back_a_possible_stop_string(engine):
    pieces = list(engine.stream("Once upon a time", 12, kv="prealloc", stop=[" Nova Haven"]))
    text = "".join(pieces)
    assert text == ", the city of"
    assert all(" Nova" not in piece for piece in pieces)


# -- signals and pipes ---------------------------------------------------------------------------


def test_ctrl_c_prints_the_metrics_so_far_and_exits_130(model_path):
    proc = subprocess.Popen([*command("model-generate"), "--kv", model_path, "Once upon a time", "400"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.read(1)  # the first token is out
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert first and (first + out).endswith(b"\n")
    lines = [line for line in err.decode().splitlines() if not line.startswith("note: ")]  # a busy machine's
    assert lines[0].startswith("model-generate: interrupted after ") and lines[0].endswith(" tokens")
    assert "Metrics" in err.decode() and "Traceback" not in err.decode()


def interrupt_on_sample(monkeypatch, after: int) -> None:
    calls = []
    real = Sampler.__call__

    def sample(self, logits):
        calls.append(1)
        if len(calls) > after:
            raise KeyboardInterrupt
        return real(self, logits)

    monkeypatch.setattr(Sampler, "__call__", sample)


@pytest.mark.parametrize("after", [0, 2])  # during the prefill; during decode
def test_ctrl_c_with_json_prints_the_partial_object(gen, monkeypatch, after):
    interrupt_on_sample(monkeypatch, after)
    code, out, err = gen("--json", "--kv", "prealloc", TINY, "Hello world", 10)
    assert code == 130
    run = json.loads(out)
    assert run["finish_reason"] == "interrupted" and len(run["token_ids"]) == after
    assert err == f"model-generate: interrupted after {after} tokens\n"


def test_ctrl_c_during_save_cache_leaves_no_file(gen, monkeypatch, tmp_path):
    from inferno.kv import snapshot

    def interrupted_write(fd, data):
        os.write(fd, data[: len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(snapshot, "_write", interrupted_write)
    code, _, err = gen("--save-cache", tmp_path / "c.safetensors", TINY, "Hello", 2)
    assert code == 130 and "interrupted" in err
    assert list(tmp_path.iterdir()) == []


def test_save_cache_into_a_read_only_directory(gen, monkeypatch, tmp_path):
    from inferno.kv import snapshot

    def read_only(fd, data):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(snapshot, "_write", read_only)
    assert_refused(gen("--save-cache", tmp_path / "c.safetensors", TINY, "Hello", 2), "model-generate",
                   "cannot save the KV cache", "Permission denied")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["model-generate", "--ignore-eos", str(TINY), "Hello", "200"],
                                  ["kv-memcalc", "--layers", "30", "--kv-heads", "3"]])
def test_a_broken_pipe_exits_0_quietly(args):
    proc = subprocess.Popen([*command(args[0]), *args[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(20)
    proc.stdout.close()  # `| head -c 20`
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0
    assert b"Traceback" not in err and b"Error" not in err


# -- bad values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "1e-310"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--seed", "-1", "--temperature", "1"], "--seed"),
        (["--stop", ""], "--stop"),
        (["--system", "be brief"], "--system needs --chat"),
        (["--prompt-file", "/nonexistent/p.txt"], "cannot read --prompt-file"),
    ],
)
def test_bad_values_are_refused_in_one_line(gen, args, fragment):
    assert_refused(gen(*args, TINY, "Hello", 2), "model-generate", fragment)


def test_a_prompt_that_is_not_utf8(gen):
    assert_refused(gen(TINY, "caf\udce9", 2), "model-generate", "not valid UTF-8")  # as argv decodes b"\xe9"


def test_absurd_layer_count(run_main):
    assert_refused(run_main(memcalc.main, "kv-memcalc", "--layers", str(10**30), "--kv-heads", "8"),
                   "kv-memcalc", "--layers")


@pytest.fixture
def unreadable(monkeypatch, tmp_path) -> Path:
    """A model file that cannot be opened (as root, where permissions do not stop a read, by failing
    its open the way the system would)."""
    path = tmp_path / "locked.gguf"
    path.write_bytes(TINY.read_bytes())
    path.chmod(0)
    if os.geteuid() == 0:
        real_open = Path.open

        def denied(self, *args, **kwargs):
            if self == path:
                raise PermissionError(13, "Permission denied", str(self))
            return real_open(self, *args, **kwargs)

        monkeypatch.setattr(Path, "open", denied)
    return path


def test_unreadable_model_file(gen, unreadable):
    assert_refused(gen(unreadable, "Hello", 2), "model-generate", "cannot read", "Permission denied")


def test_unreadable_model_file_in_memcalc(run_main, unreadable):
    assert_refused(run_main(memcalc.main, "kv-memcalc", "--model", str(unreadable)), "kv-memcalc",
                   "cannot read")


def test_memcalc_refuses_metadata_of_the_wrong_type(run_main, tmp_path):
    from gguf import GGUFValueType
    from gguf_fuzz import read_model, write_model

    model = read_model(TINY)
    next(f for f in model.fields if f[0] == "llama.context_length")[1:] = [GGUFValueType.STRING, "long"]
    path = tmp_path / "typed.gguf"
    path.write_bytes(write_model(model))
    assert_refused(run_main(memcalc.main, "kv-memcalc", "--model", str(path)), "kv-memcalc",
                   "llama.context_length should be an integer")
