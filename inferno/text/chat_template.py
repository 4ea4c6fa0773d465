"""Chat templates, rendered in the Jinja sandbox transformers renders them in (imported only by runs
that use a template: jinja2 is a noticeable part of a command's imports).

A template is untrusted code from the model file (or a --chat-template file), so rendering is bounded:
at most MAX_OUTPUT characters beyond twice the messages' own text, at most RENDER_SECONDS, no operator
or method that would build a string, list or number far past that (`'x' * 10**9`, `10 ** 10 ** 10`,
`'{:>999999999}'.format(1)`, `'%999999999d' % 1`, `s.center(10**9)`), and every failure (a syntax
error, `include` with no loader, runaway recursion, a lone surrogate in the text) is one InfernoError
line naming the template's source.
"""

from __future__ import annotations

import ctypes
import functools
import json
import operator
import re
import threading
from datetime import datetime
from functools import cache
from typing import Any, ClassVar

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inferno.errors import InfernoError

MAX_OUTPUT = 2**20  # characters a template may add to the messages' text
RENDER_SECONDS = 5.0  # a chat template renders in milliseconds; a runaway loop is stopped here
MAX_WIDTH = 10_000  # the widest padding, format width or precision a template may ask for
MAX_POWER_BITS = 100_000  # bits of the largest `a ** b` a template may compute
DEFAULT_SOURCE = "the chat template"


def render(template: str, *, template_source: str = DEFAULT_SOURCE, **variables: Any) -> str:
    """The template's text for `variables` (messages, add_generation_prompt, special tokens...).

    template_source names where the template came from in any error (a file, the model's metadata)."""
    limit = MAX_OUTPUT + 2 * _text_size(variables.get("messages"))
    try:
        text = _bounded(lambda: _collect(_compiled(template).generate(**variables), limit))
    except _TooLong:
        raise InfernoError(f"{template_source} failed: its output is more than {limit:,} characters") \
            from None
    except _TimedOut:
        raise InfernoError(f"{template_source} failed: it ran for more than {RENDER_SECONDS:g} s") from None
    except RecursionError:
        raise InfernoError(f"{template_source} failed: it recursed too deeply") from None
    except MemoryError:
        raise InfernoError(f"{template_source} failed: it ran out of memory") from None
    except Exception as exc:  # TemplateError, TypeError (include: no loader), OverflowError, ValueError...
        raise InfernoError(f"{template_source} failed: {_one_line(exc)}") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InfernoError(
            f"{template_source} failed: its output holds a lone surrogate at character {exc.start}, "
            "not UTF-8 text"
        ) from None
    return text


class _TooLong(Exception):
    pass


class _TimedOut(BaseException):  # BaseException: the template's own `except Exception` cannot swallow it
    pass


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    message = lines[0] if lines else "(no message)"
    # raise_exception's message and the sandbox's are the template's own words; others say their type
    own = type(exc) in (jinja2.TemplateError, SecurityError)
    text = message if own else f"{type(exc).__name__}: {message}"
    if isinstance(exc, jinja2.TemplateSyntaxError) and exc.lineno:
        text += f" (line {exc.lineno})"
    return text if len(text) <= 300 else text[:297] + "..."


def _text_size(messages: Any) -> int:
    if not isinstance(messages, list):
        return 0
    return sum(len(m.get("content") or "") for m in messages if isinstance(m, dict)
               and isinstance(m.get("content") or "", str))  # fmt: skip


def _collect(pieces: Any, limit: int) -> str:
    out, size = [], 0
    for piece in pieces:
        size += len(piece)
        if size > limit:
            raise _TooLong
        out.append(piece)
    return "".join(out)


def _bounded(work: Any) -> Any:
    """work() in this thread, stopped with _TimedOut after RENDER_SECONDS (an exception raised into the
    thread between two bytecodes: a template is Python code, so any loop of it is stopped)."""
    tid, lock, state = threading.get_ident(), threading.Lock(), {"done": False}

    def stop() -> None:
        with lock:
            if not state["done"]:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_TimedOut))

    timer = threading.Timer(RENDER_SECONDS, stop)
    timer.daemon = True
    timer.start()
    try:
        return work()
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)  # one not yet raised


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
    if indent is not None:
        _check_width("tojson indent", indent)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **options)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs"}  # str methods padding to a width


def _check_width(what: str, width: Any) -> None:
    if isinstance(width, int) and width > MAX_WIDTH:
        raise SecurityError(f"{what} {width:,} is wider than the {MAX_WIDTH:,} a chat template may ask for")


def _check_printf(spec: str) -> None:
    for width, precision in _PRINTF_SPEC.findall(spec):
        for value in (width, precision):
            if value == "*":
                raise SecurityError("a '*' width in a %-format is not allowed in a chat template")
            if value:
                _check_width("a %-format width", int(value))


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, str | list | tuple) else None


def _guarded_binop(op: str, left: Any, right: Any) -> Any:
    """The operators that can build huge values, refused before they do."""
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if _size(seq) is not None and isinstance(n, int) and _size(seq) * n > MAX_OUTPUT:
                raise SecurityError(f"repeating a sequence {n:,} times would pass {MAX_OUTPUT:,} items")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and (
            right > MAX_POWER_BITS or left.bit_length() * right > MAX_POWER_BITS
        ):
            raise SecurityError(f"{left} ** {right} is too large a number for a chat template")
    elif op == "+":
        if _size(left) is not None and _size(right) is not None and _size(left) + _size(right) > MAX_OUTPUT:
            raise SecurityError(f"joining these would pass {MAX_OUTPUT:,} items")
    elif op == "%" and isinstance(left, str):
        _check_printf(left)
        return _bounded_size(_OPERATORS[op](left, right))
    return _OPERATORS[op](left, right)


def _bounded_size(value: Any) -> Any:
    if _size(value) is not None and _size(value) > MAX_OUTPUT:
        raise SecurityError(f"a value of more than {MAX_OUTPUT:,} items is too large for a chat template")
    return value


def _check_replace(text: Any, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        times = len(text) + 1 if old == "" else text.count(old)
        if isinstance(count, int) and count >= 0:
            times = min(times, count)
        if len(text) + times * len(new) > MAX_OUTPUT:
            raise SecurityError(f"this replace would pass {MAX_OUTPUT:,} characters")


def _check_join(separator: Any, items: Any) -> None:
    if not (isinstance(separator, str) and isinstance(items, list | tuple)):
        return
    if len(separator) * len(items) + sum(len(i) for i in items if isinstance(i, str)) > MAX_OUTPUT:
        raise SecurityError(f"this join would pass {MAX_OUTPUT:,} characters")


def _concat(values: Any) -> str:
    """`a ~ b`, refused past MAX_OUTPUT characters before it is built (doubling a string 40 times)."""
    parts = [str(v) for v in values]
    if sum(len(p) for p in parts) > MAX_OUTPUT:
        raise SecurityError(f"joining with ~ would pass {MAX_OUTPUT:,} characters")
    return "".join(parts)


class _Generator(CodeGenerator):
    """Compiles `~` to the environment's bounded concatenation (chat templates never autoescape)."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.concat_bounded((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


_OPERATORS = {"*": operator.mul, "**": operator.pow, "+": operator.add, "%": operator.mod}


def _format_filter(value: str, *args: Any, **kwargs: Any) -> str:
    """jinja's `format` filter (printf-style), without huge widths."""
    _check_printf(str(value))
    return jinja2.filters.do_format(value, *args, **kwargs)


def _width_filter(name: str) -> Any:
    original = jinja2.filters.FILTERS[name]

    @functools.wraps(original)  # keeps jinja's pass_environment mark (wordwrap)
    def guarded(value: Any, *args: Any, **kwargs: Any) -> Any:
        for width in (*args, *kwargs.values()):
            _check_width(f"|{name} width", width)
        return original(value, *args, **kwargs)

    return guarded


def _replace_filter(eval_ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> Any:
    _check_replace(s, old, new, -1 if count is None else count)
    return jinja2.filters.do_replace(eval_ctx, s, old, new, count)


_replace_filter.jinja_pass_arg = jinja2.utils._PassArg.eval_context  # type: ignore[attr-defined]


def _join_filter(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> Any:
    if attribute is None:
        value = list(value) if not isinstance(value, str) else value
        _check_join(d, value)
    return _bounded_size(jinja2.filters.sync_do_join(eval_ctx, value, d, attribute))


_join_filter.jinja_pass_arg = jinja2.utils._PassArg.eval_context  # type: ignore[attr-defined]


class _ChatSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(_OPERATORS)
    code_generator_class = _Generator
    concat_bounded = staticmethod(_concat)

    def wrap_str_format(self, value: Any) -> None:
        return None  # str.format and format_map are then refused as unsafe attributes

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        return _guarded_binop(operator, left, right)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if isinstance(obj, str) and attr in ("format", "format_map"):
            return False  # `'{:>999999999}'.format(1)`: templates use |format or ~ instead
        return super().is_safe_attribute(obj, attr, value)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            if name in _WIDTH_METHODS:
                for width in (*args, *kwargs.values()):
                    _check_width(f"str.{name} width", width)
            elif name == "replace" and len(args) >= 2:
                _check_replace(owner, *args[:3])
            elif name == "join" and args:
                _check_join(owner, args[0])
        return super().call(__context, __obj, *args, **kwargs)


@cache
def _chat_environment() -> ImmutableSandboxedEnvironment:
    """A sandbox set up like transformers' for chat templates, which are untrusted code from the file."""
    env = _ChatSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters["format"] = _format_filter
    for name in ("center", "indent", "wordwrap"):
        env.filters[name] = _width_filter(name)
    env.filters["replace"] = _replace_filter
    env.filters["join"] = _join_filter
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
