"""Every command of the README's console blocks runs as shown: the exit status it shows (an error line
means 2), no traceback, and the first line of output it shows, numbers masked (timings differ from
machine to machine; tokens do not). The server's two commands are model-serve's own tests."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

SKIPPED = ("model-serve", "curl ")  # tests/test_serve.py starts a server on a free port instead


def blocks() -> list[tuple[str, str]]:
    """(command, the first line of output the README shows for it) in the README's console blocks."""
    text = (ROOT / "README.md").read_text()
    found = []
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("$ "):
                i += 1
                continue
            command = lines[i][2:]
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            i += 1
            shown = lines[i] if i < len(lines) and not lines[i].startswith("$ ") else ""
            found.append((command, shown))
    return found


def masked(line: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"\d+(\.\d+)?", "N", line)).strip()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("readme")
    (folder / "models").symlink_to(ROOT / "models")
    return folder


COMMANDS = [(c, s) for c, s in blocks() if not any(word in c for word in SKIPPED)]


def test_the_readme_has_its_commands():
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize(("command", "shown"), COMMANDS, ids=[c[:40] for c, _ in COMMANDS])
def test_a_readme_command_runs_as_shown(workdir, command, shown):
    jq = " | jq -c "
    wanted_json = None
    if jq in command:  # jq need not be installed: the JSON it would print is checked here instead
        command = command.split(jq)[0]
        wanted_json = json.loads(shown)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True,
                         timeout=600)
    output = run.stdout + run.stderr
    assert "Traceback" not in output, output
    assert run.returncode == (2 if ": error:" in shown else 0), output
    if wanted_json is not None:
        got = json.loads(run.stdout)
        assert {key: got[key] for key in wanted_json} == wanted_json
    elif shown and shown != "...":
        assert masked(shown) in {masked(line) for line in output.splitlines()}, output
