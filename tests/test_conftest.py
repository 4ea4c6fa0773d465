"""The suite's own rule: without the default model, tests about it skip, except under CI, where the
run fails (a CI that skips most of the suite must not look green)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from inferno.cli.common import DEFAULT_MODEL


def run_pytest_without_the_model(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    """This conftest in a checkout that has no models/, and one test that needs the model."""
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), tests)
    (tests / "test_one.py").write_text("def test_model(model_path):\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci else {})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
                          cwd=tmp_path, env=env, capture_output=True, text=True)


def test_a_missing_model_skips_outside_ci(tmp_path):
    done = run_pytest_without_the_model(tmp_path, None)
    assert done.returncode == 0 and "1 skipped" in done.stdout, done.stdout + done.stderr


def test_a_missing_model_fails_the_run_under_ci(tmp_path):
    done = run_pytest_without_the_model(tmp_path, "true")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"the model {DEFAULT_MODEL.name} is absent" in done.stdout + done.stderr
