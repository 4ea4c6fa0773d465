"""model-chat: turns reuse the cache of the earlier ones and answer as a fresh run of the whole
conversation does."""

from __future__ import annotations

import io
import json
import sys

import pytest

from inferno.cli.chat import main

PROG = "model-chat"


@pytest.fixture
def chat(run_main, monkeypatch, loaded_once):
    def talk(lines: str, *args):
        monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
        return run_main(main, PROG, *args)

    return talk


def test_a_later_turn_reuses_the_cache_and_answers_as_a_fresh_run(chat, engine, tmp_path):
    snapshot = tmp_path / "chat.st"
    code, out, err = chat(f"My name is Ada.\nWhat is my name?\n/stats\n/save {snapshot}\n", "-n", "8")
    assert code == 0, err
    first, second = out.splitlines()[:2]
    stats = next(line for line in err.splitlines() if line.startswith("cache prealloc"))
    messages = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first},
                {"role": "user", "content": "What is my name?"}]
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    fresh = engine.run(ids, 8, kv="prealloc")
    assert second == fresh.output.text
    reused = int(stats.split("last turn: ")[1].split(" tokens reused")[0])
    assert reused > len(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages[:1])))
    assert snapshot.is_file() and "saved" in err


def test_reset_forgets_the_conversation_and_bad_commands_are_one_line(chat):
    code, _, err = chat("Hi.\n/reset\n/stats\n/save\n", "-n", "4")
    assert code == 0, err
    assert "[conversation reset]" in err and "cache prealloc f32: 0 tokens" in err
    assert "/save needs a file name" in err


def test_a_model_without_a_chat_template_is_refused_in_one_line(run_main, monkeypatch, gemma_path):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    code, _, err = run_main(main, PROG, gemma_path)
    assert code == 2 and "no chat template" in err and "--chat-template" in err


def test_chat_template_file_gives_a_base_model_a_chat(run_main, gemma_path, tmp_path):
    from inferno.cli.generate import main as generate_main

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                        "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
                        "{% endif %}")
    code, out, err = run_main(generate_main, "model-generate", "--chat", "--chat-template", template,
                              "--json", gemma_path, "Hello", 4)
    assert code == 0, err
    assert json.loads(out)["prompt"].startswith("<start_of_turn>user\nHello<end_of_turn>")
    code, _, err = run_main(generate_main, "model-generate", "--chat-template", template, gemma_path, "Hi", 2)
    assert code == 2 and "--chat-template needs --chat" in err
