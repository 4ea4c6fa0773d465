"""Shared fixtures: the real default model (tests about the model skip only when it is absent, and
under CI=true its absence fails the run: a CI that skips most of the suite is not a green CI)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from inferno.cli import common
from inferno.model.prepared import CACHE_DIR_ENV

# The prepared-model cache of this session (and of the commands it runs): never the user's own.
_MODEL_CACHE = tempfile.TemporaryDirectory(prefix="inferno-tests-")
os.environ[CACHE_DIR_ENV] = _MODEL_CACHE.name

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / common.DEFAULT_MODEL
GEMMA_MODEL = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
QWEN_MODEL = ROOT / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture(autouse=True)
def no_startup_guess(monkeypatch):
    """Commands run in this process start on every thread: how busy the machine was while pytest
    started is no guide, and a note about it would be a line no test expects (the thread governor's
    own tests give it machines of their own)."""
    from inferno.runtime.threads import GOVERNOR

    monkeypatch.setattr(GOVERNOR, "others", lambda: None)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under CI a missing model fails the run: a CI that skips most of the suite is not a green CI."""
    if os.environ.get("CI", "").lower() not in ("true", "1"):
        return
    for model in (DEFAULT_MODEL, GEMMA_MODEL, QWEN_MODEL):
        if not model.is_file():
            pytest.exit(f"CI is set and the model {model.name} is absent: fetch it with `make models`",
                        returncode=1)


@pytest.fixture(scope="session")
def model_path() -> Path:
    if not DEFAULT_MODEL.is_file():
        pytest.skip(f"{DEFAULT_MODEL.name} is absent (fetch it with `make model`)")
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def engine(model_path):
    from inferno.runtime.engine import Engine

    return Engine.load(model_path)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    if not GEMMA_MODEL.is_file():
        pytest.skip(f"{GEMMA_MODEL.name} is absent (fetch it with `make model MODEL=gemma3`)")
    return GEMMA_MODEL


@pytest.fixture(scope="session")
def gemma_engine(gemma_path):
    from inferno.runtime.engine import Engine

    return Engine.load(gemma_path)


@pytest.fixture
def loaded_once(monkeypatch, engine):
    """The commands get the session's engine instead of loading the model again (seconds per run)."""
    from inferno.runtime.engine import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, path, progress=None: engine))
    return engine


@pytest.fixture
def run_main(monkeypatch, capsys) -> Callable[..., tuple[int, str, str]]:
    """Run a command's main() in this process: (exit code, stdout, stderr)."""

    def run(main: Callable[[], None], prog: str, *args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", [prog, *map(str, args)])
        try:
            main()
            code = 0
        except SystemExit as done:
            code = done.code or 0
        out, err = capsys.readouterr()
        return code, out, err

    return run


def greedy(engine, ids: list[int], n: int, mode: str = "prealloc") -> tuple[list[int], list]:
    """n greedy tokens after ids with a cache of layout `mode`, and the logits each was chosen from."""
    import numpy as np

    from inferno.kv import make_cache

    cache = make_cache(mode, engine.config.kv_geometry, len(ids) + n)
    logits = engine.model.prefill(np.array(ids), cache)
    out, seen = [], []
    for _ in range(n):
        seen.append(logits)
        out.append(int(np.argmax(logits)))
        if len(out) < n:
            logits = engine.model.decode(out[-1], cache.length, cache)
    return out, seen
