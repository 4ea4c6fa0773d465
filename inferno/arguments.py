"""Argument checks for the Python API: a wrong type or value is one InfernoError naming the argument,
never a TypeError from deep inside (`generate("hi", "3")`) or a misleading message."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from numbers import Integral
from typing import Any

from inferno.errors import InfernoError


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def count(name: str, value: Any, minimum: int = 1, maximum: int | None = None) -> int:
    """`value` as an int of at least `minimum` (and at most `maximum`); bools and floats are refused."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise InfernoError(f"{name} must be an integer, got {type(value).__name__} {_shown(value)}")
    value = int(value)
    if value < minimum:
        raise InfernoError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InfernoError(f"{name} must be at most {maximum:,}, got {value:,}")
    return value


def optional_count(name: str, value: Any, minimum: int = 1) -> int | None:
    return None if value is None else count(name, value, minimum)


def text(name: str, value: Any, optional: bool = False) -> str | None:
    """A str that is valid UTF-8 (no lone surrogates)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise InfernoError(f"{name} must be a str, got {type(value).__name__} {_shown(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InfernoError(f"{name} is not valid UTF-8 (it holds a lone surrogate)") from None
    return value


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InfernoError(f"{name} must be True or False, got {type(value).__name__} {_shown(value)}")
    return value


def path(name: str, value: Any) -> str | os.PathLike:
    if isinstance(value, bytes) or not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise InfernoError(f"{name} must be a path (str or os.PathLike) to a .gguf file, got {_shown(value)}")
    return value


def token_ids(name: str, value: Any, vocab_size: int | None = None) -> list[int]:
    """A non-empty sequence of token ids, each an int in the vocabulary."""
    listed = isinstance(value, Sequence) or hasattr(value, "tolist")  # a list, a tuple, a numpy array
    if isinstance(value, str | bytes) or not listed:
        raise InfernoError(f"{name} must be a list of token ids, got {type(value).__name__} {_shown(value)}")
    ids = list(value.tolist() if hasattr(value, "tolist") else value)
    if not ids:
        raise InfernoError(f"{name} is empty: give at least one token id")
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, Integral):
            raise InfernoError(f"{name}[{i}] must be an integer token id, got {_shown(token)}")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            top = "" if vocab_size is None else f" (0..{vocab_size - 1})"
            raise InfernoError(f"{name}[{i}] = {token} is outside the vocabulary{top}")
    return [int(t) for t in ids]


def choice(name: str, value: Any, valid: Sequence[str], optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or value not in valid:
        raise InfernoError(f"{name} {_shown(value)} is not one of {', '.join(valid)}")
    return value


def shown_path(path: str | os.PathLike) -> str:
    """A path in a one-line message: a name of thousands of characters shortened."""
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else str(path)
    text = str(text)
    return text if len(text) <= 200 else f"{text[:100]}... ({len(text):,} characters)"


def special_file(path: str | os.PathLike) -> str | None:
    """What `path` is when it exists and is not a regular file (symlinks followed): "a FIFO (named
    pipe)", "a character device", "a directory"...; None for a regular file or nothing there."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # absent, a loop of symlinks, a name too long: opening it says why
        return None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), None)
