"""The package map holds: inferno's packages import only down the pipeline (no cycles between them, no
import from a lower stage back up to a higher one), and docs/architecture.md names every module and
every console script."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "inferno"

# Lowest first: a module may import from its own stage and the stages before it. The top level
# (inferno/__init__.py, errors.py and arguments.py: the one exception and the Python API's argument
# checks) is the floor every stage stands on.
STAGES = ("errors", "file", "text", "kernels", "kv", "model", "runtime", "analysis", "plan", "bench",
          "serve", "cli")

# Imports that go up the pipeline, each with why it stays. (importer, imported): module names.
EXCEPTIONS = {
    ("inferno.file.config", "inferno.kv.geometry"):
        "ModelConfig.kv_geometry hands out the cache's one description of its shape; geometry.py is a "
        "dataclass that imports only inferno.errors",
    ("inferno.kernels.attention", "inferno.kv.blocks"):
        "attention_decode is the float32-rows case of the cache's one decode-attention kernel "
        "(kv.blocks.attend_rows), which is built from this module's pieces; imported at call time",
    ("inferno.runtime.metrics", "inferno.analysis.token_log"):
        "a type annotation only (under TYPE_CHECKING): a RunRecord carries the per-token log",
    ("inferno.bench.__main__", "inferno.cli.common"):
        "`python -m inferno.bench` is itself a command: it shares the commands' runner and default model",
    ("inferno.bench.matvec", "inferno.cli.common"):
        "`python -m inferno.bench.matvec` is itself a command: it shares the commands' default model",
    ("inferno.bench.report", "inferno.cli.common"):
        "the benchmark report prints through the commands' console (NO_COLOR, pipes, widths)",
    ("inferno.bench.batch_sweep", "inferno.cli.generate_many"):
        "kv-bench --batch-sweep measures model-generate --many's own path, not a copy of it",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in STAGES) else "errors"


def imports(module: str) -> set[str]:
    """The inferno modules `module` imports anywhere in its text: at the top, inside functions, under
    TYPE_CHECKING."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "inferno"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "inferno":
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found - {module}


EDGES = {(m, target) for m in MODULES for target in imports(m)}


def test_every_import_names_a_module_that_exists():
    assert {target for _, target in EDGES} <= set(MODULES)


def test_every_module_sits_in_a_known_stage():
    assert {stage(m) for m in MODULES} <= set(STAGES)


def test_no_import_goes_up_the_pipeline():
    upward = {(m, t) for m, t in EDGES if STAGES.index(stage(t)) > STAGES.index(stage(m))}
    assert upward - EXCEPTIONS.keys() == set()
    assert EXCEPTIONS.keys() - upward == set(), "an exception no longer needed: remove it"


def test_no_import_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for m, t in EDGES - EXCEPTIONS.keys():
        if stage(m) != stage(t):
            graph.setdefault(stage(m), set()).add(stage(t))
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"import cycle: {' -> '.join((*path, node))}"
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, (*path, node))
        done.add(node)

    for node in sorted(graph):
        visit(node, ())


def test_architecture_md_names_every_module_and_console_script():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(inferno/[\w/]*(?:\.py|/))`", text))
    for module, path in MODULES.items():
        rel = path.relative_to(ROOT).as_posix()
        package = rel.endswith("/__init__.py") and rel != "inferno/__init__.py"
        want = rel[: -len("__init__.py")] if package else rel
        assert want in named, f"docs/architecture.md does not name {want} ({module})"
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    scripts = re.findall(r"^([\w-]+) = ", section, re.M)
    assert scripts
    for script in scripts:
        assert f"`{script}`" in text, f"docs/architecture.md does not name the console script {script}"
