"""Two versions of inferno in one process, their decode steps alternating: a change measured against
the code before it on a shared, noisy machine.

    python -m inferno.bench.ab MODEL.gguf BEFORE AFTER [--steps 150] [--rounds 3] [--activations int8]

BEFORE and AFTER are git revisions of this checkout, or `worktree` for the files as they are now. Each
is copied under its own package name (its `inferno` imports renamed), both are imported, each loads
the model and prefills the same tokens into its own cache, and their decode steps take turns (the
order flipping every step). Separate processes minutes apart see the machine's other tenants come
and go; here both versions see the same minutes. Two copies of one version differ by a few percent:
run `ab MODEL HEAD HEAD` for the noise of the day. Reports the median step of each per round, with
BEFORE's over AFTER's (above 1x: AFTER is faster), and whether the two gave the same logits bit for bit.

The copies are kept (the cache directory, by content), so their Numba kernels compile once.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import io
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numba
import numpy as np

import inferno
from inferno.model.prepared import cache_dir

WORKTREE = "worktree"
_IMPORT = re.compile(r"\binferno\b(?=[.\s])")  # the package's name where it is imported or qualified


def package_files(revision: str) -> dict[str, bytes]:
    """The package's source files at `revision` (WORKTREE: as they are on disk), by path inside it."""
    root = Path(inferno.__file__).parent
    if revision == WORKTREE:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.py"))}
    archive = subprocess.run(["git", "-C", str(root.parent), "archive", revision, "inferno"],
                             capture_output=True, check=False)
    if archive.returncode:
        raise ValueError(f"git archive {revision}: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        return {m.name.removeprefix("inferno/"): tar.extractfile(m).read()  # type: ignore[union-attr]
                for m in tar.getmembers() if m.isfile() and m.name.endswith(".py")}


def install(files: dict[str, bytes], where: Path) -> str:
    """The files as a package of their own under `where`, named by their content: its name."""
    digest = hashlib.sha256(b"".join(k.encode() + v for k, v in sorted(files.items()))).hexdigest()[:12]
    name = f"inferno_{digest}"
    package = where / name
    if not package.exists():  # written beside it, then renamed: never seen half written
        draft = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=where))
        for path, text in files.items():
            target = draft / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(_IMPORT.sub(name, text.decode()))
        try:
            draft.rename(package)
        except OSError:  # another run installed it first
            shutil.rmtree(draft)
    return name


class Version:
    """One version's model, with `depth` tokens prefilled into a cache that holds `steps` more."""

    def __init__(self, name: str, model_path: str, activations: str, depth: int, steps: int):
        self.model = importlib.import_module(f"{name}.model.prepared").load(model_path).model
        if activations != "f32":
            self.model.set_activations(activations)
        self._kv = importlib.import_module(f"{name}.kv")
        self.cache = self._prefilled(depth, depth + steps)

    def _prefilled(self, depth: int, capacity: int) -> object:
        """A prealloc cache holding `depth` tokens (the same ones for every version)."""
        cache = self._kv.make_cache("prealloc", self.model.config.kv_geometry, capacity)
        vocab = self.model.embedding.rows
        self.model.prefill(np.random.default_rng(0).integers(0, vocab, depth), cache)
        return cache

    def step(self) -> None:
        """One decode step on the timed cache (the same token each time)."""
        self.model.decode(1, self.cache.length, self.cache)

    def logits(self) -> np.ndarray:
        """A 4-token prompt's logits and three decode steps'. Prefilled through the integer dots, not
        BLAS, whose float sums vary with where each version's buffers happen to lie."""
        cache = self._prefilled(4, 8)
        return np.stack([self.model.decode(1, cache.length, cache) for _ in range(3)])


def alternating(versions: list[Version], steps: int) -> list[float]:
    """Median seconds of a decode step of each version, over `steps` each, the versions taking turns."""
    times: list[list[float]] = [[] for _ in versions]
    for i in range(steps):
        for k in range(len(versions)) if i % 2 == 0 else reversed(range(len(versions))):
            t0 = time.perf_counter()
            versions[k].step()
            times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("before", help=f"git revision, or {WORKTREE}")
    parser.add_argument("after", help=f"git revision, or {WORKTREE}")
    parser.add_argument("--steps", type=int, default=150, help="decode steps per version per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depth", type=int, default=4, help="tokens in the cache before the steps")
    parser.add_argument("--activations", default="f32", choices=("f32", "int8"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if min(args.steps, args.rounds, args.depth) < 1:
        parser.error("--steps, --rounds and --depth take at least 1")
    where = cache_dir() / "ab"
    where.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(where))
    try:
        names = [install(package_files(revision), where) for revision in (args.before, args.after)]
    except ValueError as e:
        parser.exit(2, f"ab: {e}\n")
    numba.set_num_threads(args.threads)
    refused = tuple(importlib.import_module(f"{name}.errors").InfernoError for name in names)
    try:  # each version raises its own copy's InfernoError
        versions = [Version(name, args.model, args.activations, args.depth, 1 + args.steps * args.rounds)
                    for name in names]
    except (*refused, OSError) as e:
        parser.exit(2, f"ab: {e}\n")
    for v in versions:
        v.step()  # the first step of each: its first touch of memory
    same = np.array_equal(versions[0].logits(), versions[1].logits())
    print(f"{Path(args.model).name}: {args.before} against {args.after}, {args.steps} decode steps each "
          f"per round, {args.activations} activations, {args.threads} threads; logits bit for bit "
          f"{'the same' if same else 'different'}")
    for r in range(args.rounds):
        before, after = (seconds * 1e3 for seconds in alternating(versions, args.steps))
        print(f"round {r + 1}: {args.before} {before:.2f} ms, {args.after} {after:.2f} ms a step "
              f"({before / after:.3f}x)")


if __name__ == "__main__":
    main()
