"""model-serve end to end: the server runs as a subprocess (`python -m inferno.cli.serve --port 0`) on
127.0.0.1, started once per module; round trips go through the official openai client, error cases and
disconnects through raw httpx."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from inferno.cli.common import set_threads
from inferno.runtime.threads import GOVERNOR
from inferno.serve.app import model_id

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1.gguf"
START_TIMEOUT_S = 180
# Greedy tokens of a batch can differ from a run alone where two tokens are nearly tied (batched float
# sums differ). These questions were picked because SmolLM2's answers to them showed no such tie: their
# 12 greedy tokens are the same alone and eight at once.
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "What does a bee make?",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water?",
]
NEW_TOKENS = 12
SYSTEM = ("You are a patient assistant for a small public library. You answer questions about opening "
          "hours, borrowing rules, late fees, the reading room, printing, the children's corner, events "
          "and the catalogue. You keep answers short and friendly, you never invent a rule you were not "
          "told, and when you do not know something you say so and suggest asking at the front desk. ") * 2


class Server:
    """A model-serve subprocess; its stderr is collected as it comes."""

    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "inferno.cli.serve", *args, "--port", "0"],
                                     cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        self.url: str | None = None
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stderr:
                self.lines.append(line)
                found = re.search(r"listening on (http://\S+)", line)
                if found:
                    self.url = found.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(START_TIMEOUT_S) or self.url is None:
            self.proc.kill()
            raise RuntimeError("model-serve did not start:\n" + "".join(self.lines))

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(f"inferno:{name}{{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


@pytest.fixture(scope="module")
def server(model_path):
    srv = Server(str(model_path), "--max-batch", "8", "--step-tokens", "256", "--max-waiting", "64",
                 "--threads", "1")
    yield srv
    code = srv.stop(signal.SIGINT)
    assert code == 130, srv.stderr  # Ctrl-C's exit code, after a clean stop
    assert "Traceback" not in srv.stderr, srv.stderr
    assert "interrupted: stopped" in srv.stderr


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


@contextmanager
def one_thread():
    """The kernels on one thread, as the test server runs them: on a busy 2-core machine two threads per
    parallel loop wait on each other's preemption (a 37-token prefill took 3-8 s, 0.6 s on one)."""
    before = GOVERNOR.fixed
    set_threads(1)
    try:
        yield
    finally:
        GOVERNOR.fix(before)


@pytest.fixture(scope="module")
def references(engine):
    """model-generate's greedy tokens for each question, through the chat template, computed in this
    process: {question: RunRecord}."""
    with one_thread():
        return {q: engine.generate(q, NEW_TOKENS, chat=True) for q in QUESTIONS}


def generated(ids: list[int], engine) -> list[int]:
    """The served token ids without the stop token that ended them (model-generate leaves it out)."""
    return ids[:-1] if ids and engine.tokenizer.is_stop(ids[-1]) else ids


def chat(client, question: str, **options):
    return client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": question}], max_tokens=NEW_TOKENS,
        temperature=0, extra_body={"return_token_ids": True}, **options)


# -- round trips through the openai client -----------------------------------------------------------


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_chat_greedy_equals_generate(client, engine, references):
    question = QUESTIONS[0]
    response = chat(client, question)
    ref = references[question]
    choice = response.choices[0]
    assert choice.message.content == ref.text
    assert generated(choice.token_ids, engine) == ref.token_ids
    assert choice.finish_reason == ref.finish_reason
    assert response.usage.prompt_tokens == len(ref.prompt_ids)
    assert response.usage.completion_tokens == len(choice.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_chat_stream_with_usage_and_content_parts(client, references):
    question = QUESTIONS[1]
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": [{"type": "text", "text": question}]}],
        max_tokens=NEW_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == references[question].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [references[question].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-1].usage.prompt_tokens == len(references[question].prompt_ids)


def test_completions_greedy_equals_generate_streamed_and_not(client, engine):
    prompt = "The three largest planets of the solar system are"
    with one_thread():
        ref = engine.generate(prompt, NEW_TOKENS)
    whole = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    assert whole.choices[0].text == ref.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == NEW_TOKENS
    pieces = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in pieces) == ref.text


def test_eight_concurrent_greedy_requests_equal_generate(client, engine, references, server):
    def ask(question: str) -> tuple[str, list[int]]:
        choice = chat(client, question).choices[0]
        return choice.message.content, generated(choice.token_ids, engine)

    steps = server.metric("num_requests_running")  # 0: nothing else runs
    assert steps == 0
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(ask, QUESTIONS))
    for question, (text, ids) in zip(QUESTIONS, answers, strict=True):
        assert ids == references[question].token_ids, question
        assert text == references[question].text


def test_logprobs_from_the_sampled_distribution(client):
    response = chat(client, QUESTIONS[2], logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert content
    for entry in content:
        assert entry.logprob <= 0
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.token == entry.top_logprobs[0].token  # greedy: the likeliest token
        assert entry.logprob == pytest.approx(tops[0])
    completion = client.completions.create(model=MODEL_ID, prompt="One, two, three,", max_tokens=4,
                                           temperature=0, logprobs=2)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.top_logprobs[0]) == 2
    assert "".join(lp.tokens) == completion.choices[0].text
    assert lp.text_offset[0] == 0


def test_n_choices_sampled_with_seed_and_stop(client, engine):
    options = dict(model=MODEL_ID, prompt="My favourite fruit is", max_tokens=12, temperature=1.0, seed=7,
                   n=3, stop=["\n"], extra_body={"return_token_ids": True})
    first = client.completions.create(**options)
    again = client.completions.create(**options)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seed + i per choice
    assert all("\n" not in c.text for c in first.choices)
    assert first.usage.prompt_tokens == len(engine.tokenizer.encode("My favourite fruit is"))  # once
    assert first.usage.completion_tokens == sum(len(c.token_ids) for c in first.choices)


def test_cached_tokens_for_a_shared_prefix(client, server, engine):
    hits = server.metric("prefix_cache_hits_total")
    usages, prompts = [], []
    for question in ("When do you open on Sundays?", "How many books can I borrow?"):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        response = client.chat.completions.create(model=MODEL_ID, max_tokens=4, temperature=0,
                                                  messages=messages)
        usages.append(response.usage)
        prompts.append(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages)))
    assert [u.prompt_tokens for u in usages] == [len(p) for p in prompts]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
    assert shared > 100
    # every whole block of the shared system prompt was found in the prefix cache, not computed again
    assert usages[1].prompt_tokens_details.cached_tokens == shared // 16 * 16
    assert server.metric("prefix_cache_hits_total") - hits >= shared // 16 * 16


# -- raw HTTP: errors, disconnects, metrics -----------------------------------------------------------


def post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={"Content-Type": "application/json"},
                      timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_bad_requests_get_openai_errors(server, engine):
    chat_path, completions = "/v1/chat/completions", "/v1/completions"
    ok = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_error(post(server, chat_path, "{not json"), 400)
    assert_error(post(server, chat_path, "[1, 2]"), 400)
    assert_error(post(server, chat_path, ok | {"max_tokens": "5"}), 400, "max_tokens")
    assert_error(post(server, chat_path, ok | {"temperature": "hot"}), 400, "temperature")
    assert_error(post(server, chat_path, ok | {"temperature": 2.5}), 400, "temperature")  # OpenAI: 0 to 2
    assert_error(post(server, chat_path, ok | {"stream": 1}), 400, "stream")
    usage = {"stream_options": {"include_usage": True}}
    assert_error(post(server, chat_path, ok | usage), 400, "stream_options")  # without stream
    assert_error(post(server, chat_path, ok | {"stop": ["a", "b", "c", "d", "e"]}), 400, "stop")
    assert_error(post(server, chat_path, {"model": MODEL_ID}), 400, "messages")
    assert_error(post(server, chat_path, ok | {"messages": [{"role": "tool", "content": "x"}]}), 400)
    assert_error(post(server, chat_path, ok | {"model": "gpt-4o"}), 404, "model", "model_not_found")
    lone = post(server, chat_path, json.dumps(ok | {"model": "\udfff x"}))  # echoed in the error: escaped
    assert assert_error(lone, 404, "model")["message"].startswith("The model `\udfff x`")
    assert_error(post(server, completions, {"model": MODEL_ID, "prompt": ""}), 400, "prompt")
    context = engine.config.context_length
    long_prompt = list(range(1000, 1000 + context + 10))
    assert_error(post(server, completions, {"model": MODEL_ID, "prompt": long_prompt}), 400, "prompt",
                 "context_length_exceeded")
    assert_error(post(server, completions, {"model": MODEL_ID, "prompt": "Hello", "max_tokens": context}),
                 400, "max_tokens", "context_length_exceeded")
    assert_error(post(server, completions, {"model": MODEL_ID, "prompt": "Hi", "presence_penalty": 1}),
                 400, "presence_penalty")
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    # unknown fields are ignored, and the server still serves
    served = post(server, completions, {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 2,
                                         "temperature": 0, "some_extension": {"x": 1}})
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2


def test_a_file_name_that_is_not_utf8_is_served_under_a_name_json_can_carry():
    assert model_id(Path(os.fsdecode(b"/models/tiny-\xff.gguf"))) == "tiny-\ufffd.gguf"
    assert model_id("/models/tiny.gguf") == "tiny.gguf"


def test_disconnected_streams_are_aborted(server):
    aborted = server.metric("request_success_total", 'finished_reason="abort"')
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "Tell me a long story."}],
                       "max_tokens": 1000, "temperature": 0.7, "stream": True, "ignore_eos": True})
    clients = [httpx.Client(timeout=60) for _ in range(8)]
    streams = []
    try:
        for c in clients:
            cm = c.stream("POST", f"{server.url}/v1/chat/completions", content=body,
                          headers={"Content-Type": "application/json"})
            streams.append((cm, cm.__enter__()))
        # each iterator is kept: dropping one would close its connection (httpcore closes on GeneratorExit)
        readers = [response.iter_lines() for _, response in streams]
        for (_, response), lines in zip(streams, readers, strict=True):
            assert response.status_code == 200
            data = (line for line in lines if line.startswith("data:"))
            next(data), next(data)  # the role chunk, then a first token: it is running
        assert server.metric("num_requests_running") == 8
    finally:
        for cm, _ in streams:
            cm.__exit__(None, None, None)
        for c in clients:
            c.close()
    deadline = time.monotonic() + 2
    while server.metric("num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("num_requests_running") == 0
    assert server.metric("num_requests_waiting") == 0
    assert server.metric("kv_cache_usage_perc") == 0
    assert server.metric("request_success_total", 'finished_reason="abort"') == aborted + 8
    # a client that stops waiting for a whole (not streamed) answer has its request aborted too
    with pytest.raises(httpx.ReadTimeout):
        whole = body.replace('"stream": true', '"stream": false')
        httpx.post(f"{server.url}/v1/chat/completions", content=whole,
                   headers={"Content-Type": "application/json"}, timeout=httpx.Timeout(60, read=1.5))
    deadline = time.monotonic() + 2
    while server.metric("num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("num_requests_running") == 0
    assert server.metric("request_success_total", 'finished_reason="abort"') == aborted + 9


def test_metrics_come_from_request_records(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total"):
        assert f"# TYPE inferno:{name} " in text
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds"):
        assert f"# TYPE inferno:{name} histogram" in text
        assert re.search(rf'inferno:{name}_bucket{{[^}}]*le="\+Inf"}} [1-9]', text)
    assert server.metric("prompt_tokens_total") >= server.metric("prefix_cache_hits_total") > 0
    assert server.metric("generation_tokens_total") > 0


# -- a second server: a model without a chat template, an API key, a full queue, SIGTERM ---------------


def test_gemma_without_template_full_queue_api_key_and_sigterm(gemma_path):
    srv = Server(str(gemma_path), "--max-batch", "1", "--max-waiting", "1", "--api-key", "secret",
                 "--threads", "1")
    try:
        auth = {"Authorization": "Bearer secret", "Content-Type": "application/json"}
        model = gemma_path.name
        assert_error(httpx.get(f"{srv.url}/v1/models"), 401, code="invalid_api_key")
        assert_error(httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert httpx.get(f"{srv.url}/v1/models", headers=auth).json()["data"][0]["id"] == model
        chat_body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        error = assert_error(httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body, headers=auth), 400)
        assert "chat template" in error["message"]
        long = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                           "ignore_eos": True})
        a, b = httpx.Client(timeout=60, headers=auth), httpx.Client(timeout=60, headers=auth)
        with a, b, a.stream("POST", f"{srv.url}/v1/completions", content=long) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # running now
            with b.stream("POST", f"{srv.url}/v1/completions", content=long) as waiting:
                assert waiting.status_code == 200  # queued behind the batch of one
                deadline = time.monotonic() + 10
                while srv.metric("num_requests_waiting") < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                t = time.monotonic()
                full = httpx.post(f"{srv.url}/v1/completions", headers=auth,
                                  json={"model": model, "prompt": "Hi", "max_tokens": 2})
                assert_error(full, 503)
                assert time.monotonic() - t < 2  # at once, not after a slot frees
            # SIGTERM with a stream in flight: it ends (finish_reason "abort"), the process exits 0
            srv.proc.send_signal(signal.SIGTERM)
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            assert rest and rest[-1]["choices"][0]["finish_reason"] == "abort"
        assert srv.proc.wait(30) == 0
        assert "Traceback" not in srv.stderr, srv.stderr
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_chat_template_flag_renders_like_the_model(engine):
    from inferno.serve.app import render_chat

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ eos_token }}"
    rendered = render_chat(engine.tokenizer, template, messages)
    assert rendered == "[system] Be brief.\n[user] Hi\n<|im_end|>"  # the model's eos_token
    assert render_chat(engine.tokenizer, None, messages) == engine.tokenizer.apply_chat_template(messages)


def test_bench_serve_reports_against_the_server(server, capsys):
    from inferno.bench import serve as bench

    code = bench.main(["--url", server.url, "--clients", "2", "--requests", "2", "--max-tokens", "4",
                       "--system-words", "60", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"] == 2 and report["errors"] == 0
    assert report["output_tokens"] == 8 and report["output_tok_s"] > 0
    assert report["ttft_p50_s"] > 0 and 0 <= report["prefix_hit_ratio"] <= 1
    with pytest.raises(SystemExit, match="not a loopback address"):
        bench.main(["--url", "http://example.com:8080"])


def test_bench_serve_prefix_reuse_reports_each_requests_ttft_and_cached_tokens(server, capsys):
    from inferno.bench import serve as bench

    code = bench.main(["--url", server.url, "--prefix-reuse", "--system-words", "97", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert code == 0 and got["first_ttft_s"] > 0 and got["second_ttft_s"] > 0
    # The second finds every full block of the shared system prompt (the first may find some of
    # another test's prompts, which start with the same words).
    shared = got["prompt_tokens"] - 24  # the user turn's tokens and the template's around them, at most
    assert got["second_cached_tokens"] >= shared // 16 * 16 > got["first_cached_tokens"] - 16
