"""The request schema of the OpenAI API as far as model-serve honours it (pydantic, strict types: `"5"` is
not a number, `1` is not a boolean), and OpenAI's error object.

Fields OpenAI has and this server does not implement are refused when they would change the answer
(penalties, logit_bias, tools, a JSON response format, echo, suffix, best_of); fields nobody here knows
are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP_STRINGS = 4  # OpenAI's bound
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat (completions allow 5; we allow 20 there too)
MAX_N = 128  # OpenAI's bound


class APIError(Exception):
    """An answer that is an OpenAI error object: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


class ErrorResponse(JSONResponse):
    """An error object as JSON with every non-ASCII character escaped: an error may quote what the client
    sent, a lone surrogate included (JSON's \\udfff), which UTF-8 cannot encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class _Schema(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Schema):
    include_usage: bool | None = False


class ContentPart(_Schema):
    type: str
    text: str | None = None


class Message(_Schema):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Sampling(_Schema):
    """What both endpoints take."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # OpenAI's range and default (1.0)
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # extension (vLLM's): -1 or 0 is off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    ignore_eos: bool | None = False  # extension: generate through end-of-sequence tokens
    return_token_ids: bool | None = False  # extension (vLLM's): the token ids of prompt and choices

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported by this server (leave it out or 0)", name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    @property
    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} sequences, got {len(stops)}", "stop")
        if "" in stops:
            raise bad_request("a stop sequence is empty", "stop")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools or self.functions:
            raise bad_request("tools and functions are not supported by this server", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("response_format other than text is not supported by this server",
                              "response_format")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_logprob_count(self) -> int | None:
        """Alternatives per token, None when no logprobs were asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise bad_request("echo is not supported by this server", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of other than n is not supported by this server", "best_of")

    @property
    def new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def top_logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("the prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


def parse(schema: type[_Schema], raw: bytes) -> Any:
    """The request body as `schema`, or a 400 saying what is wrong with it, naming the field."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    except RecursionError:  # `[[[[...` 100,000 deep: json's recursive decoder gives up
        raise bad_request("the body nests arrays or objects too deeply") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    try:
        request = schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(part) for part in first["loc"]]
        # a union reports each branch's type in the path (`stop.str`): name the field, not the branch
        field = ".".join(part for part in loc if part not in _TYPE_NAMES)
        missing = first["type"] == "missing"
        message = f"{field} is required" if missing else f"{field}: {first['msg']}"
        if not missing and "input" in first and not isinstance(first["input"], dict | list):
            message += f" (got {json.dumps(first['input'])})"
        raise bad_request(message, field or None) from None
    request.refuse_unsupported()
    return request


_TYPE_NAMES = {"str", "int", "float", "bool", "list[str]", "list[int]", "list[list[int]]",
               "list[ContentPart]", "function-after", "constrained-int", "constrained-float"}

Role = Literal["system", "developer", "user", "assistant"]
ROLES = ("system", "developer", "user", "assistant")


def chat_messages(messages: list[Message]) -> list[dict[str, str]]:
    """The messages as the chat template takes them: a role and string content (text parts joined,
    `developer` read as `system`)."""
    out = []
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise bad_request(f"messages[{i}].role {message.role!r} is not supported "
                              f"(one of {', '.join(ROLES)})", f"messages[{i}].role")
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content[{j}] of type {part.type!r} is not supported "
                                      "(text parts only)", f"messages[{i}].content")
                texts.append(part.text)
            content = "".join(texts)
        if content is None:
            if message.role != "assistant":
                raise bad_request(f"messages[{i}].content is required", f"messages[{i}].content")
            content = ""
        role = "system" if message.role == "developer" else message.role
        out.append({"role": role, "content": content})
    return out
