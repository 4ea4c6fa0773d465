"""Chat templates, rendered in the Jinja sandbox transformers renders them in (imported only by runs
that use a template: jinja2 is a noticeable part of a command's imports)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from typing import Any, ClassVar

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inferno.errors import InfernoError


def render(template: str, **variables: Any) -> str:
    """The template's text for `variables` (messages, add_generation_prompt, special tokens...)."""
    try:
        return _compiled(template).render(**variables)
    except jinja2.TemplateError as exc:
        raise InfernoError(f"chat template failed: {exc}") from None


@cache
def _compiled(template: str) -> jinja2.Template:
    return _chat_environment().from_string(template)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we keep the body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **options: Any) -> str:
    """transformers' `tojson`: unlike jinja's own, it does not HTML-escape."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **options)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


@cache
def _chat_environment() -> ImmutableSandboxedEnvironment:
    """A sandbox set up like transformers' for chat templates, which are untrusted code from the file."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
