"""What every inferno command shares: one-line errors with exit code 2, consoles, threads, the default
model and how a positional argument is recognised as one."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import NoReturn

import click

from inferno.errors import InfernoError

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
DEFAULT_MODEL = Path("models") / "SmolLM2-135M-Instruct.Q4_1.gguf"  # relative to a checkout


def fail(prog: str, message: str) -> NoReturn:
    first_line = message.strip().splitlines()[0] if message.strip() else "failed"
    click.echo(f"{prog}: error: {first_line}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def run(command: click.Command, prog: str) -> None:
    """Run a click command; bad flags and InfernoError become one line on stderr and exit code 2."""
    try:
        # Not command.main(): it turns a broken pipe into exit code 1 before we could see it.
        with command.make_context(prog, sys.argv[1:]) as ctx:
            command.invoke(ctx)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.ClickException as bad:
        fail(prog, bad.format_message())
    except InfernoError as bad:
        fail(prog, str(bad))
    except (KeyboardInterrupt, click.Abort):
        click.echo(f"{prog}: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as Unix tools do. stdout now points at
        # /dev/null, so the interpreter's last flush of what is still buffered cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


def script(main: Callable[[], None]) -> Callable[[], NoReturn]:
    """A console script's entry point: `main()`, then the process ends at once with its exit code.

    Python's own teardown of everything a run loaded (modules, Numba's dispatchers, the model) took
    about 130 ms of a 1.1 s 32-token run and does nothing a finished command needs: files are closed
    and snapshots written or removed inside the command. Tests call `main()` itself."""

    def entry() -> NoReturn:
        try:
            main()
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
            if not isinstance(done.code, int | None):
                print(done.code, file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            with suppress(BrokenPipeError, ValueError):  # the reader went away: nothing to deliver
                stream.flush()
        os._exit(code)

    return entry


def version_option() -> Callable:
    """`--version` for a command: its name and inferno's version."""
    return click.version_option(package_name="inferno", message="%(prog)s %(version)s")


def utf8(what: str, text: str) -> str:
    """`text` from the command line, refused when it is not valid UTF-8 (Python hands such bytes over
    as lone surrogates, which no tokenizer or terminal can take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InfernoError(f"{what} is not valid UTF-8") from None
    return text


@contextmanager
def blame(flag: str, value: object) -> Iterator[None]:
    """Library errors name values, not flags: inside this block, one about a value the user set with
    `flag` says so (nothing is added when the flag was not given)."""
    try:
        yield
    except InfernoError as bad:
        if value is None:
            raise
        raise InfernoError(f"{bad} ({flag} {value})") from None


def default_model() -> Path:
    """$INFERNO_MODEL, else models/ in the working directory, else models/ of this checkout."""
    if os.environ.get("INFERNO_MODEL"):
        return Path(os.environ["INFERNO_MODEL"])
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / DEFAULT_MODEL).is_file():
            return root / DEFAULT_MODEL
    raise InfernoError(
        f"no model given and the default model is not at {DEFAULT_MODEL}: "
        "fetch it with `make model` (bin/fetch-model), or pass a .gguf path"
    )


def looks_like_model(arg: str) -> bool:
    """A positional argument is a model path when it says so (.gguf) or is a GGUF file; a file that
    happens to be named like the prompt is not."""
    return arg.endswith(".gguf") or is_gguf_file(arg)


def is_gguf_file(path: str) -> bool:
    from inferno.gguf_file import GGUF_MAGIC  # here: kv-memcalc by flags starts without numpy

    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:  # absent, a directory, unreadable
        return False


def check_activations(name: str) -> None:
    """--activations names how the matrix-vector products take activations, or a one-line refusal."""
    from inferno.nibble_dots import ACTIVATIONS

    if name not in ACTIVATIONS:
        raise InfernoError(f"--activations {name!r}: expected one of {', '.join(ACTIVATIONS)}")


def set_threads(threads: int | None) -> None:
    """Cap every thread pool we use (Numba's and the BLAS behind numpy) at `threads`.

    Works whenever it is called: the BLAS limit goes through threadpoolctl to the library numpy has
    already loaded. (How long idle workers spin is set in inferno/__init__.py.)
    """
    if threads is None:
        return
    if threads < 1:
        raise InfernoError(f"--threads must be at least 1, got {threads}")
    import numba
    from threadpoolctl import threadpool_limits

    available = numba.config.NUMBA_NUM_THREADS
    if threads > available:
        raise InfernoError(f"--threads {threads} is more than the {available} this machine has")
    numba.set_num_threads(threads)
    threadpool_limits(threads)


def console(stderr: bool = False):
    """A rich console; rich itself honours NO_COLOR and drops styling when not writing to a terminal."""
    from rich.console import Console

    class QuietOnBrokenPipe(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError  # to run(), which exits 0 (rich's own handler exits 1)

    return QuietOnBrokenPipe(stderr=stderr, highlight=False)


def progress_on(console) -> Callable[[str], AbstractContextManager] | None:
    """Engine.load's progress callback showing each step as a spinner on `console` (None: quiet)."""
    if console is None:
        return None

    def step(message: str) -> AbstractContextManager:
        return console.status(message)

    return step
