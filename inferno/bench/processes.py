"""One measurement, one process: its wall time, its own peak RSS, and the JSON report it prints.

A process per measurement means no engine warms another's caches and each peak RSS is that
measurement's alone (read with wait4, which Popen.wait would throw away). Linux starts a child's peak
at its parent's high-water mark, so the harness keeps itself small: its heavy work runs `aside`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import inferno

# The folder holding the inferno package: children started there with `-m inferno...` run this very
# inferno, whatever the caller's working directory.
SOURCE_ROOT = Path(inferno.__file__).resolve().parents[1]


def aside(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a fresh process of its own, so that what it allocates (a tokenizer of 262,144
    tokens peaks at half a GB) never becomes the floor of a measured child's peak RSS."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


@dataclass
class ChildResult:
    ok: bool
    wall_s: float
    peak_rss_mib: float
    report: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def run_child(cmd: list[str], env: dict[str, str], timeout: float) -> ChildResult:
    """Run one child; wall time covers the whole process, peak RSS is its own (wait4's rusage)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                cwd=SOURCE_ROOT)
        killer = threading.Timer(timeout, lambda: os.kill(proc.pid, signal.SIGKILL))
        killer.start()
        # Reap it ourselves: Popen.wait() would discard the rusage that wait4 returns.
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    rss = usage.ru_maxrss / 1024  # KiB on Linux
    if proc.returncode != 0:
        lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        why = "timed out" if proc.returncode == -signal.SIGKILL else f"exit code {proc.returncode}"
        return ChildResult(False, wall, rss, error=f"{why}: {lines[-1] if lines else 'no output'}")
    try:
        report = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return ChildResult(False, wall, rss, error=f"no JSON on stdout: {stdout.strip()[:200]!r}")
    return ChildResult(True, wall, rss, report)


def probe(python: str, modules: list[str]) -> dict[str, bool]:
    """Which modules `python` can find, without importing them (torch alone takes seconds)."""
    code = ("import importlib.util, json, sys\n"
            "def found(m):\n"
            "    try:\n        return importlib.util.find_spec(m) is not None\n"
            "    except ModuleNotFoundError:\n        return False\n"
            "print(json.dumps({m: found(m) for m in sys.argv[1:]}))")
    try:
        done = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True, timeout=60)
        return json.loads(done.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return dict.fromkeys(modules, False)


def machine() -> dict[str, Any]:
    """CPU, cores, Python and the 1-minute load average (other people's work, when taken first)."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0],
            "load_before": round(os.getloadavg()[0], 2)}


def inferno_version() -> str:
    """The package version and the checkout's commit, marked dirty when the tree has changes."""
    label = f"inferno {inferno.__version__}"
    try:
        git = ["git", "-C", str(SOURCE_ROOT)]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return label
    return f"{label} @ {commit}{'+dirty' if dirty else ''}" if commit else label
