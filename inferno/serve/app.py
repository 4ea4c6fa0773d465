"""The HTTP side of model-serve: a FastAPI app that parses, tokenizes and streams, and leaves the model to
the engine thread (`EngineLoop`).

    GET  /v1/models            the served model (its file name is its id)
    POST /v1/completions       prompt: a string, a list of strings, token ids or lists of token ids
    POST /v1/chat/completions  messages rendered with the chat template
    GET  /health               200 while the engine thread runs, 503 otherwise
    GET  /metrics              Prometheus text (inferno.serve.metrics)

Errors are OpenAI's object {"error": {"message", "type", "param", "code"}}, always before a stream starts.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferno.errors import InfernoError
from inferno.model.sampling import MIN_TEMPERATURE, Sampler
from inferno.runtime.scheduler import Request as EngineRequest
from inferno.runtime.scheduler import SchedulerFullError
from inferno.serve.engine_loop import EngineLoop, Item, LogProb, Submission
from inferno.serve.metrics import ServerMetrics
from inferno.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    bad_request,
    chat_messages,
    error_body,
    parse,
)
from inferno.text.tokenizer import GGUFTokenizer

SEED_RANGE = 2**63


@dataclass
class ServeConfig:
    model_id: str  # what /v1/models lists and responses name: the model's file name
    max_sequence: int  # prompt + completion tokens one request may hold: the context, or what the pool holds
    vocab_size: int
    chat_template: str | None = None  # --chat-template: overrides the model's
    has_model_template: bool = False
    api_key: str | None = None
    aliases: set[str] = field(default_factory=set)  # other names a request may give the model
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None or self.has_model_template


@dataclass
class Prepared:
    """A request turned into the scheduler's terms."""

    prompts: list[list[int]]  # token ids of each distinct prompt
    max_new_tokens: int
    n: int


def create_app(engine_loop: EngineLoop, tokenizer: GGUFTokenizer, metrics: ServerMetrics,
               config: ServeConfig) -> FastAPI:
    app = FastAPI(title="inferno model-serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_loop, app.state.metrics, app.state.config = engine_loop, metrics, config

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return ErrorResponse(exc.body(), exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        body = error_body(str(exc.detail), "invalid_request_error", None, code)
        return ErrorResponse(body, exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(_request: Request, exc: Exception) -> JSONResponse:
        return ErrorResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        good = hmac.compare_digest(key.strip().encode(), config.api_key.encode())
        if scheme.lower() != "bearer" or not good:
            raise APIError(401, "Incorrect API key provided: give it as `Authorization: Bearer KEY`.",
                           "invalid_request_error", None, "invalid_api_key")

    def check_model(name: str) -> None:
        if name != config.model_id and name not in config.aliases:
            raise APIError(404, f"The model `{name}` does not exist (this server serves "
                                f"`{config.model_id}`).",
                           "invalid_request_error", "model", "model_not_found")

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine_loop.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(f"the engine thread is not running: {engine_loop.failed or 'stopped'}",
                                       "server_error"), 503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse({"object": "list", "data": [{
            "id": config.model_id, "object": "model", "created": config.created, "owned_by": "inferno",
            "max_model_len": config.max_sequence,
        }]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> JSONResponse:
        authorize(request)
        check_model(name)
        return JSONResponse({"id": config.model_id, "object": "model", "created": config.created,
                             "owned_by": "inferno", "max_model_len": config.max_sequence})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        body: ChatCompletionRequest = parse(ChatCompletionRequest, await request.body())
        check_model(body.model)
        if not config.has_chat_template:
            raise bad_request("this model has no chat template: use /v1/completions, or start model-serve "
                              "with --chat-template FILE", "messages", "chat_template_missing")
        messages = chat_messages(body.messages)
        prepared = await run_in_threadpool(prepare_chat, tokenizer, config, body, messages)
        return await answer(request, body, prepared, Chat(config.model_id, body))

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        body: CompletionRequest = parse(CompletionRequest, await request.body())
        check_model(body.model)
        prepared = await run_in_threadpool(prepare_completion, tokenizer, config, body)
        return await answer(request, body, prepared, Completion(config.model_id, body))

    async def answer(request: Request, body, prepared: Prepared, shape: Shape):
        requests = engine_requests(body, prepared)
        try:
            sub = await engine_loop.submit(requests, body.top_logprob_count)
        except SchedulerFullError as exc:
            raise APIError(503, f"the server is busy: {exc}; try again later", "server_error", None,
                           "server_overloaded") from None
        except InfernoError as exc:
            raise bad_request(str(exc)) from None
        if body.stream:
            return EngineStream(stream(sub, shape, prepared, body.include_usage),
                                on_close=lambda: engine_loop.abort(sub))
        watcher = asyncio.create_task(abort_on_disconnect(request, lambda: engine_loop.abort(sub)))
        try:
            results = await collect(sub, len(requests), watcher)
        finally:
            watcher.cancel()
            engine_loop.abort(sub)  # a no-op for requests that finished; frees any a failure left going
        return JSONResponse(shape.response(results, prepared))

    return app


# -- preparing a request (in a worker thread: templates and tokenizing) --------------------------------


def render_chat(tokenizer: GGUFTokenizer, template: str | None, messages: list[dict[str, str]]) -> str:
    """The prompt text of `messages`: the model's chat template, or `template` (--chat-template) rendered
    the same way, with the model's special tokens (bos_token, eos_token...)."""
    return tokenizer.apply_chat_template(messages, template=template)


def prepare_chat(tokenizer: GGUFTokenizer, config: ServeConfig, body: ChatCompletionRequest,
                 messages: list[dict[str, str]]) -> Prepared:
    try:
        text = render_chat(tokenizer, config.chat_template, messages)
    except InfernoError as exc:
        raise bad_request(str(exc), "messages") from None
    ids = encode_prompt(tokenizer, config, text, "messages")
    bos = tokenizer.bos_id
    if bos is not None and ids[:2] == [bos, bos]:  # the template wrote bos_token, and encode added one
        ids = ids[1:]
    return Prepared([ids], new_tokens(config, [ids], body.new_tokens, "messages"), body.n or 1)


def prepare_completion(tokenizer: GGUFTokenizer, config: ServeConfig, body: CompletionRequest) -> Prepared:
    prompts = []
    for prompt in body.prompts:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("the prompt is empty", "prompt")
            prompts.append(encode_prompt(tokenizer, config, prompt, "prompt"))
        else:
            bad = [t for t in prompt if not 0 <= t < config.vocab_size]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{config.vocab_size - 1})",
                                  "prompt")
            prompts.append(list(prompt))
    return Prepared(prompts, new_tokens(config, prompts, body.new_tokens, "prompt"), body.n or 1)


def encode_prompt(tokenizer: GGUFTokenizer, config: ServeConfig, text: str, param: str) -> list[int]:
    """The prompt's token ids; a 400 for text that is not UTF-8 (a lone surrogate, which JSON's \\ud800
    can write) or that must be longer than the context, refused before all of it is tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"the {param} holds a lone surrogate at character {exc.start}: not UTF-8 text",
                          param) from None
    try:
        return tokenizer.encode(text, config.max_sequence)
    except InfernoError as exc:
        raise bad_request(f"This model's maximum context length is {config.max_sequence} tokens. However, "
                          f"the {exc}", param, "context_length_exceeded") from None


def new_tokens(config: ServeConfig, prompts: list[list[int]], asked: int | None, param: str) -> int:
    """Tokens to generate: as asked, or by default up to the context; a 400 when the prompt leaves no
    room or prompt + asked tokens do not fit."""
    longest = max(len(p) for p in prompts)
    limit = config.max_sequence
    if longest == 0:
        raise bad_request("the prompt is empty (0 tokens)", param)
    if longest >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt is "
                          f"{longest} tokens, which leaves no room for a completion.", param,
                          "context_length_exceeded")
    if asked is None:
        return limit - longest
    if longest + asked > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{longest + asked} tokens ({longest} in the prompt, {asked} in the completion).",
                          "max_tokens", "context_length_exceeded")
    return asked


def engine_requests(body, prepared: Prepared) -> list[EngineRequest]:
    """n requests per prompt (choice p * n + j), sampling seed + j each when a seed is given."""
    temperature = 1.0 if body.temperature is None else body.temperature
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0
    top_k = body.top_k if body.top_k and body.top_k > 0 else 0
    top_p = 1.0 if body.top_p is None else body.top_p
    stops = body.stops
    out = []
    for ids in prepared.prompts:
        for j in range(prepared.n):
            seed = None if body.seed is None else (body.seed + j) % SEED_RANGE
            try:
                sampler = Sampler(temperature, top_k, top_p, seed)
            except InfernoError as exc:
                raise bad_request(str(exc).replace("--", "")) from None
            out.append(EngineRequest(list(ids), prepared.max_new_tokens, sampler, stops,
                                     bool(body.ignore_eos)))
    return out


# -- waiting for results -----------------------------------------------------------------------------


@dataclass
class Choice:
    index: int
    text: str = ""
    logprobs: list[LogProb] = field(default_factory=list)
    finish_reason: str | None = None
    item: Item | None = None  # the last one: its generation is the record

    def add(self, item: Item) -> None:
        self.text += item.text
        if item.logprob is not None:
            self.logprobs.append(item.logprob)
        if item.finish_reason is not None:
            self.finish_reason, self.item = item.finish_reason, item


async def abort_on_disconnect(request: Request, abort: Callable[[], None]) -> None:
    """Wait for the client to go away (the body is read: the next message is http.disconnect) and abort
    its requests, so their sequences and blocks are freed at the next step."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    abort()


async def collect(sub: Submission, count: int, watcher: asyncio.Task) -> list[Choice]:
    """Every choice to its end."""
    choices = [Choice(i) for i in range(count)]
    remaining = count
    while remaining:
        for item in await sub.queue.get():
            choices[item.index].add(item)
            remaining -= item.finish_reason is not None
    for choice in choices:
        if choice.finish_reason == "error":
            raise APIError(500, f"generation failed: {choice.item.error}", "server_error")
        if choice.finish_reason == "abort":
            if watcher.done():  # nobody reads this answer
                raise APIError(499, "the client closed the request")
            raise APIError(503, "the request was aborted: the server is shutting down", "server_error")
    return choices


class EngineStream(StreamingResponse):
    """A server-sent event stream whose requests are aborted when it ends early: the client went away
    (Starlette cancels the stream at its http.disconnect) or the send failed."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()  # after a complete stream every request has ended: nothing to abort


def sse(data: dict | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


async def stream(sub: Submission, shape: Shape, prepared: Prepared,
                 include_usage: bool) -> AsyncIterator[str]:
    count = len(sub.requests)
    choices = [Choice(i) for i in range(count)]
    for i in range(count):
        first = shape.first_chunk(i)
        if first is not None:
            yield sse(shape.chunk(first, include_usage))
    remaining = count
    while remaining:
        items = await sub.queue.get()
        for item in items:
            choice = choices[item.index]
            choice.add(item)
            remaining -= item.finish_reason is not None
            if item.finish_reason == "error":
                yield sse(error_body(f"generation failed: {item.error}", "server_error"))
                continue
            if item.text or item.logprob is not None or item.finish_reason is not None:
                yield sse(shape.chunk(shape.delta(item), include_usage))
    if include_usage:
        yield sse(shape.chunk(None, True) | {"choices": [], "usage": usage(choices, prepared)})
    yield sse("[DONE]")


def usage(choices: list[Choice], prepared: Prepared) -> dict:
    """From the requests' Metrics records: prompt tokens once per distinct prompt (its n choices share
    it), completion tokens of every choice, cached tokens the prefix cache held of each prompt."""
    records = [c.item.generation.metrics if c.item and c.item.generation else None for c in choices]
    prompt = cached = completion = 0
    for p in range(len(prepared.prompts)):
        group = [m for m in records[p * prepared.n : (p + 1) * prepared.n] if m is not None]
        if group:
            prompt += group[0].prompt_tokens
            cached += min(m.reused_tokens for m in group)
    completion = sum(m.generated_tokens for m in records if m is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# -- the two response shapes -------------------------------------------------------------------------


class Shape:
    """How one endpoint's responses and chunks look."""

    object: str
    chunk_object: str
    prefix: str

    def __init__(self, model: str, body):
        self.model, self.body = model, body
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def chunk(self, choice: dict | None, include_usage: bool) -> dict:
        out = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
               "system_fingerprint": None, "choices": [choice] if choice is not None else []}
        if include_usage:
            out["usage"] = None
        return out

    def first_chunk(self, index: int) -> dict | None:
        return None

    def delta(self, item: Item) -> dict:
        raise NotImplementedError

    def response(self, choices: list[Choice], prepared: Prepared) -> dict:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
               "system_fingerprint": None, "choices": [self.choice(c) for c in choices],
               "usage": usage(choices, prepared)}
        if self.body.return_token_ids:
            out["prompt_token_ids"] = prepared.prompts[0] if len(prepared.prompts) == 1 else prepared.prompts
        return out

    def choice(self, choice: Choice) -> dict:
        raise NotImplementedError

    def token_ids(self, choice: Choice) -> dict:
        if not self.body.return_token_ids or choice.item is None or choice.item.generation is None:
            return {}
        return {"token_ids": list(choice.item.generation.token_ids)}


class Chat(Shape):
    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def first_chunk(self, index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, item: Item) -> dict:
        logprobs = None
        if item.logprob is not None:
            logprobs = {"content": [chat_logprob(item.logprob)], "refusal": None}
        delta = {"content": item.text} if item.text or item.finish_reason is None else {}
        return {"index": item.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": item.finish_reason}

    def choice(self, choice: Choice) -> dict:
        logprobs = None
        if self.body.logprobs:
            logprobs = {"content": [chat_logprob(lp) for lp in choice.logprobs], "refusal": None}
        return {"index": choice.index, "message": {"role": "assistant", "content": choice.text,
                                                   "refusal": None},
                "logprobs": logprobs, "finish_reason": choice.finish_reason, **self.token_ids(choice)}


def chat_logprob(lp: LogProb) -> dict:
    t = lp.token
    return {"token": t.text, "logprob": t.logprob, "bytes": t.bytes,
            "top_logprobs": [{"token": a.text, "logprob": a.logprob, "bytes": a.bytes} for a in lp.top]}


class Completion(Shape):
    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, model: str, body):
        super().__init__(model, body)
        self.offsets: dict[int, int] = {}  # per choice: characters of token text so far (text_offset)

    def delta(self, item: Item) -> dict:
        logprobs = None
        if item.logprob is not None:
            logprobs = self.logprobs(item.index, [item.logprob])
        return {"index": item.index, "text": item.text, "logprobs": logprobs,
                "finish_reason": item.finish_reason}

    def logprobs(self, index: int, lps: list[LogProb]) -> dict:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        for lp in lps:
            offset = self.offsets.get(index, 0)
            out["tokens"].append(lp.token.text)
            out["token_logprobs"].append(lp.token.logprob)
            out["top_logprobs"].append({a.text: a.logprob for a in lp.top})
            out["text_offset"].append(offset)
            self.offsets[index] = offset + len(lp.token.text)
        return out

    def choice(self, choice: Choice) -> dict:
        logprobs = self.logprobs(choice.index, choice.logprobs) if self.body.logprobs is not None else None
        return {"index": choice.index, "text": choice.text, "logprobs": logprobs,
                "finish_reason": choice.finish_reason, **self.token_ids(choice)}


def model_id(path: str | Path) -> str:
    """The file's name; bytes of it that are not UTF-8 (which no JSON answer can carry) as U+FFFD."""
    return os.fsencode(Path(path).name).decode("utf-8", "replace")
