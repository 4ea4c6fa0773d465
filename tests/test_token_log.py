"""The per-token log (--log-tokens): records checked against the logits they came from, phases, EOS."""

from __future__ import annotations

import json

import numpy as np
import pytest

from inferno.analysis.token_log import EOS_LINE, TokenLog, probabilities
from inferno.cli.generate import main as generate_main
from inferno.runtime.metrics import Metrics
from inferno.runtime.scheduler import Generation, Request

PROG = "model-generate"


class Vocabulary:
    """A tokenizer stand-in: token i reads "t<i>", and token 3 is end-of-sequence."""

    def token_text(self, token_id: int) -> str:
        return f"t{token_id}"

    def is_stop(self, token_id: int) -> bool:
        return token_id == 3


def test_probabilities_are_the_softmax_of_the_logits():
    want = np.array([0.5, 0.25, 0.125, 0.125])
    logits = (np.log(want) + 7.0).astype(np.float32)  # softmax ignores a constant shift
    np.testing.assert_allclose(probabilities(logits), want, rtol=1e-6)


def test_record_holds_the_chosen_token_and_the_top_alternatives_in_order():
    logits = np.log(np.array([0.1, 0.6, 0.2, 0.1], dtype=np.float32))
    generation = Generation(0, Request([5, 6], 4), None, Metrics(2, 2, 1, per_forward_ms=[12.5]),
                            tokens=[5, 6, 2], logits=logits)
    log = TokenLog(Vocabulary(), cache=None, top_k=2)
    record = log.add(generation)
    assert (record.step, record.phase, record.token_id, record.text) == (1, "full", 2, "t2")
    assert record.prob == pytest.approx(0.2, rel=1e-6)
    assert [(a.token_id, a.text) for a in record.top] == [(1, "t1"), (2, "t2")]
    assert [a.prob for a in record.top] == pytest.approx([0.6, 0.2], rel=1e-6)
    assert record.forward_ms == 12.5 and record.cache_length is None
    assert not record.end_of_sequence and EOS_LINE not in record.line()


def test_end_of_sequence_is_marked_and_its_line_says_so():
    logits = np.zeros(4, np.float32)
    generation = Generation(0, Request([5], 4), None, Metrics(1, 1, 1, per_forward_ms=[1.0]),
                            tokens=[5, 3], finish_reason="stop", logits=logits)
    record = TokenLog(Vocabulary(), cache=None).add(generation)
    assert record.end_of_sequence and record.top == ()
    assert record.line().endswith("\n" + EOS_LINE)


@pytest.fixture
def generate(run_main):
    return lambda *args: run_main(generate_main, PROG, *args)


def test_json_log_follows_the_run_forward_by_forward(generate, model_path):
    prompt = "The capital of France is"
    code, out, _ = generate("--json", "--kv", "prealloc", "--log-tokens=3", model_path, prompt, 5)
    assert code == 0
    run = json.loads(out)
    log, metrics = run["token_log"], run["metrics"]
    prompt = len(run["prompt_ids"])
    assert [r["token_id"] for r in log] == run["token_ids"]
    assert [r["phase"] for r in log] == ["prefill"] + ["decode"] * 4
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5]
    assert [r["forward_ms"] for r in log] == metrics["per_forward_ms"]
    assert [r["cache_length"] for r in log] == [prompt + i for i in range(5)]
    for r in log:
        probs = [a["prob"] for a in r["top"]]
        assert len(probs) == 3 and probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-9
        assert r["top"][0]["token_id"] == r["token_id"]  # greedy takes the likeliest
        assert r["prob"] == probs[0]
    assert log[0]["text"] == " Paris"


def test_text_log_goes_to_stderr_and_the_text_to_stdout(generate, model_path):
    code, out, err = generate("--kv", "--log-tokens", model_path, "The capital of France is", 3)
    assert code == 0
    steps = [line for line in err.splitlines() if line.startswith("step")]
    assert len(steps) == 3 and "prefill" in steps[0] and "decode" in steps[1]
    assert " Paris." in out and "step" not in out


def test_no_cache_logs_full_forwards(generate, model_path):
    code, out, _ = generate("--json", "--log-tokens", model_path, "Hello", 2)
    assert code == 0
    log = json.loads(out)["token_log"]
    assert [r["phase"] for r in log] == ["full", "full"] and log[0]["top"] == []
    assert all(r["cache_length"] is None for r in log)


def test_negative_alternatives_are_refused(generate, model_path):
    code, _, err = generate("--log-tokens=-1", model_path, "Hello", 2)
    assert code == 2 and "--log-tokens" in err
