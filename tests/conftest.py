"""Shared fixtures: the real models, SmolLM2 (the default) and Gemma 3 (tests about a model skip only
when it is absent; `make test` fetches both)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from inferno.cli.common import SPIN_COUNT

os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)  # as the commands do

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_MODEL = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture(scope="session")
def model_path() -> Path:
    if not DEFAULT_MODEL.is_file():
        pytest.skip(f"{DEFAULT_MODEL.name} is absent (fetch it with `make model`)")
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def engine(model_path):
    from inferno.engine import Engine

    return Engine.load(model_path)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    if not GEMMA_MODEL.is_file():
        pytest.skip(f"{GEMMA_MODEL.name} is absent (fetch it with `make model MODEL=gemma3`)")
    return GEMMA_MODEL


@pytest.fixture(scope="session")
def gemma_engine(gemma_path):
    from inferno.engine import Engine

    return Engine.load(gemma_path)


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
