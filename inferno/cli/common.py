"""What every inferno command shares: one-line errors with exit code 2, consoles, threads, the default
model and how a positional argument is recognised as one."""

from __future__ import annotations

import errno
import io
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import NoReturn

import click

from inferno.errors import InfernoError

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM: a `kill` unwinds as Ctrl-C does (temp files removed), then this
STDOUT_CLOSED = "standard output is closed (`>&-`): redirect it to a file or /dev/null instead"
DEFAULT_MODEL = Path("models") / "SmolLM2-135M-Instruct.Q4_1.gguf"  # relative to a checkout
# Names a model argument may be instead of a path: the files bin/fetch-model (and the Makefile) fetch.
MODEL_FILES = {"smollm2": DEFAULT_MODEL, "gemma3": Path("models") / "gemma-3-270m-q4_k_m.gguf",
               "qwen": Path("models") / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"}


def fail(prog: str, message: str) -> NoReturn:
    global _notes
    _notes = None  # a refusal is the one line: notes held from the start-up are dropped
    first_line = message.strip().splitlines()[0] if message.strip() else "failed"
    say(f"{prog}: error: {first_line}")
    sys.exit(EXIT_BAD_INPUT)


_notes: list[str] | None = None  # notes held while a command starts (None: each said at once)


def note(message: str) -> None:
    """`note: message` on stderr; inside run() held until the command's work begins (release_notes),
    so that input refused after the model loaded is still one line, not a note about threads and it."""
    if _notes is not None:
        _notes.append(message)
    else:
        say(f"note: {message}")


def release_notes() -> None:
    """Say the notes held since the command started, and from now on each at once."""
    global _notes
    held, _notes = _notes or [], None
    for message in held:
        say(f"note: {message}")


def say(line: str) -> None:
    """One line on stderr, if there is a stderr to write to."""
    with suppress(OSError, ValueError, AttributeError):
        click.echo(line, err=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised wherever the program is: it unwinds as Ctrl-C does (a half-written snapshot's
    temp file is removed, a run stops where it is), and the command exits EXIT_TERMINATED."""


class _ClosedOutput(io.RawIOBase):
    """What stdout is when the command was started with it closed: every write fails with EBADF."""

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        raise OSError(errno.EBADF, STDOUT_CLOSED)


def stdout_closed() -> bool:
    """True when the command was started with stdout closed (`>&-`): nothing it prints can be delivered."""
    stream = sys.stdout
    if stream is None or isinstance(getattr(getattr(stream, "buffer", None), "raw", None), _ClosedOutput):
        return True
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return False  # not a file descriptor (a test's capture): writable as far as we know
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def physical_memory() -> int | None:
    """Bytes of RAM this machine has (None where the OS does not say): what no request may need more of."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(what: str, needed: int) -> None:
    """Refuse, before any work, a request whose KV cache alone would need more than the machine's RAM."""
    total = physical_memory()
    if total is not None and needed > total:
        raise InfernoError(
            f"{what} need {needed / 2**30:,.1f} GiB of KV cache, more than this machine's "
            f"{total / 2**30:,.1f} GiB of memory"
        )


def require_stdout() -> None:
    """For commands whose output is their point: refuse before any work when stdout is closed."""
    if stdout_closed():
        raise InfernoError(STDOUT_CLOSED)


_signalled: list[int] = []  # SIGTERM, once received during run()


def _terminate(signum: int, frame) -> None:
    _signalled.append(signum)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second kill does not interrupt the clean-up
    raise Terminated


def run(command: click.Command, prog: str) -> None:
    """Run a click command; bad flags and InfernoError become one line on stderr and exit code 2.

    Ctrl-C exits 130 and SIGTERM 143, each with one line; a closed stdout is one line, exit 2."""
    if sys.stdout is None:  # started with fd 1 closed: writes fail with one line, not AttributeError
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(_ClosedOutput()), line_buffering=True)
    global _notes
    _signalled.clear()
    _notes = []
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        # Not command.main(): it turns a broken pipe into exit code 1 before we could see it.
        with command.make_context(prog, sys.argv[1:]) as ctx:
            command.invoke(ctx)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except SystemExit as done:  # a command that stopped on its own after a KeyboardInterrupt
        if done.code == EXIT_INTERRUPTED and _signalled:
            sys.exit(EXIT_TERMINATED)  # (it was a SIGTERM)
        raise
    except click.ClickException as bad:
        fail(prog, bad.format_message())
    except InfernoError as bad:
        fail(prog, str(bad))
    except Terminated:
        say(f"{prog}: terminated")
        sys.exit(EXIT_TERMINATED)
    except (KeyboardInterrupt, click.Abort):
        say(f"{prog}: interrupted")
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as Unix tools do. stdout now points at
        # /dev/null, so the interpreter's last flush of what is still buffered cannot fail again.
        with suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except OSError as exc:
        if exc.errno != errno.EBADF and exc.errno != errno.ENOSPC:
            raise
        # stdout closed (`>&-`) or full (`>/dev/full`): nothing more can be delivered
        _drop_stdout()
        fail(prog, STDOUT_CLOSED if exc.errno == errno.EBADF else f"cannot write the output: {exc.strerror}")
    except MemoryError:
        fail(prog, "out of memory: ask for less (a shorter prompt or context, fewer samples)")
    finally:
        release_notes()  # (none after a refusal)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _drop_stdout() -> None:
    """Replace stdout by /dev/null so the interpreter's last flush of what is buffered cannot fail again."""
    with suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (lives until the process ends)


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
            with suppress(OSError, ValueError, AttributeError):  # the reader went away, or fd closed
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


def _fetched(relative: Path) -> Path | None:
    """`relative` (models/...) in the working directory, else in this checkout; None when in neither."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / relative).is_file():
            return root / relative
    return None


def default_model() -> Path:
    """$INFERNO_MODEL, else models/ in the working directory, else models/ of this checkout."""
    if os.environ.get("INFERNO_MODEL"):
        return Path(os.environ["INFERNO_MODEL"])
    found = _fetched(DEFAULT_MODEL)
    if found is None:
        raise InfernoError(
            f"no model given and the default model is not at {DEFAULT_MODEL}: "
            "fetch it with `make model` (bin/fetch-model), or pass a .gguf path"
        )
    return found


def model_file(arg: str | os.PathLike | None) -> Path:
    """A command's model argument as a file: none given is the default model; a name bin/fetch-model
    knows (smollm2, gemma3, qwen) is its file in models/, unless a file of that very name is here."""
    if arg is None:
        return default_model()
    name = str(arg)
    if name not in MODEL_FILES or os.path.exists(name):
        return Path(arg)
    found = _fetched(MODEL_FILES[name])
    if found is None:
        raise InfernoError(f"model {name} is not fetched: run `bin/fetch-model {name}`")
    return found


def looks_like_model(arg: str) -> bool:
    """A positional argument is a model when it says so (.gguf, or a name such as smollm2) or is a GGUF
    file; a file that happens to be named like the prompt is not."""
    return arg.endswith(".gguf") or arg in MODEL_FILES or is_gguf_file(arg)


def is_gguf_file(path: str) -> bool:
    from inferno.file.reader import GGUF_MAGIC  # here: kv-memcalc by flags starts without numpy

    if not os.path.isfile(path):  # a FIFO is never opened here: that would wait for a writer forever
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:  # absent, a directory, unreadable
        return False


def check_activations(name: str) -> None:
    """--activations names how the matrix-vector products take activations, or a one-line refusal."""
    from inferno.kernels.activation_parts import ACTIVATIONS

    if name not in ACTIVATIONS:
        raise InfernoError(f"--activations {name!r}: expected one of {', '.join(ACTIVATIONS)}")


def set_threads(threads: int | None, measured: bool = True) -> None:
    """--threads N runs the kernels on N threads for the whole run. Without it the runtime chooses the
    count step by step by measuring (inferno.runtime.threads) and says so once on stderr when other
    processes' load makes fewer threads faster; or, not `measured` (a benchmark, which compares fixed
    settings), uses them all. (How long idle workers spin is set in inferno/__init__.py.)"""
    from inferno.runtime.threads import GOVERNOR

    GOVERNOR.notice = note
    if threads is None:
        GOVERNOR.fix(None if measured else GOVERNOR.most)
        return
    if threads < 1:
        raise InfernoError(f"--threads must be at least 1, got {threads}")
    if threads > GOVERNOR.most:
        raise InfernoError(f"--threads {threads} is more than the {GOVERNOR.most} this process may use")
    GOVERNOR.fix(threads)


def console(stderr: bool = False):
    """A rich console; rich itself honours NO_COLOR and drops styling when not writing to a terminal,
    and into a pipe or file the lines it prints end without the spaces that pad them to the width."""
    from rich.console import Console

    class QuietOnBrokenPipe(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError  # to run(), which exits 0 (rich's own handler exits 1)

    stream = sys.stderr if stderr else sys.stdout
    with suppress(AttributeError, ValueError, OSError):
        if not stream.isatty():
            return QuietOnBrokenPipe(file=_Unpadded(stderr), highlight=False)
    return QuietOnBrokenPipe(stderr=stderr, highlight=False)


class _Unpadded:
    """sys.stdout or sys.stderr (whichever it is when written to) without the spaces ending each line
    of a write: what rich pads a table or a title with is noise in a file or a pipe."""

    def __init__(self, stderr: bool):
        self._stderr = stderr

    @property
    def _stream(self):
        return sys.stderr if self._stderr else sys.stdout

    def write(self, text: str) -> int:
        *lines, last = text.split("\n")
        self._stream.write("".join(line.rstrip(" ") + "\n" for line in lines) + last)
        return len(text)

    def __getattr__(self, name: str):  # flush, isatty, encoding, fileno: the stream's own
        return getattr(self._stream, name)


def progress_on(console) -> Callable[[str], AbstractContextManager] | None:
    """Engine.load's progress callback showing each step as a spinner on `console` (None: quiet).

    The kernel step says whether they load from Numba's disk cache or compile (see kernels_cached)."""
    if console is None:
        return None

    def step(message: str) -> AbstractContextManager:
        if message.startswith("compiling kernels"):
            message = KERNEL_STEPS[kernels_cached()]
        return console.status(message)

    return step


KERNEL_STEPS = {True: "loading kernels", False: "compiling kernels (first run)",
                None: "loading or compiling kernels"}
KERNEL_MODULES = ("inferno.kernels.ops", "inferno.kernels.attention", "inferno.kernels.quant",
                  "inferno.kernels.quant_batch", "inferno.kernels.nibble_dots",
                  "inferno.kernels.activation_parts", "inferno.kernels.dequant",
                  "inferno.kernels.repack")


def kernels_cached() -> bool | None:
    """True when Numba's on-disk cache holds kernels of every kernel module for this CPU and source
    (each module's index file is read: about 10 ms), False when some module has none (the first run,
    or its source changed), None when it cannot be told."""
    import hashlib

    try:
        from numba.core.dispatcher import Dispatcher
        from numba.core.registry import cpu_target

        magic = cpu_target.target_context.codegen().magic_tuple()
        verdicts = []
        for name in KERNEL_MODULES:
            hits = None
            for kernel in getattr(sys.modules.get(name), "__dict__", {}).values():
                index = getattr(getattr(kernel, "_cache", None), "_cache_file", None)
                if not isinstance(kernel, Dispatcher) or index is None:
                    continue
                code = hashlib.sha256(kernel.py_func.__code__.co_code).hexdigest()
                found = any(key[1] == magic and key[2][0] == code for key in index._load_index())
                hits = bool(hits) or found
            if hits is not None:
                verdicts.append(hits)
        return all(verdicts) if verdicts else None
    except Exception:  # Numba's internals moved: say so rather than guess
        return None


def quiet_console(quiet: bool, as_json: bool = False):
    """The stderr console progress and metrics go to, or None when --quiet or --json keep it silent."""
    return None if quiet or as_json else console(stderr=True)


def threads_option(measured: bool = True) -> Callable:
    default = ("chosen step by step by measuring, up to every CPU this process may use" if measured
               else "every CPU this process may use")
    return click.option("--threads", type=int, default=None,
                        help=f"Threads for the kernels (default: {default}).")


def quiet_option() -> Callable:
    return click.option("--quiet", "-q", is_flag=True,
                        help="No progress and no metrics on stderr (the output itself is unchanged).")


MAX_TEMPLATE_BYTES = 1 << 20
TEXT_FILE_LIMIT = 2 << 20  # bytes of a text scored token by token: kv-perplexity --text, kv-bench --text-file


def read_template(path: str) -> str:
    """A --chat-template file's text (UTF-8, at most MAX_TEMPLATE_BYTES)."""
    return read_text_file("--chat-template", path, MAX_TEMPLATE_BYTES, "a template")


def read_text_file(
    flag: str, path: str, limit: int, what: str = "it", encoding: str = "utf-8", or_else: str = ""
) -> str:
    """The UTF-8 text of the file a flag names, at most `limit` bytes. A FIFO, device, socket or
    directory is refused before it is opened (a FIFO nobody writes to blocks the open forever,
    /dev/zero never ends), a larger file before it is read. or_else: what else the flag takes, said
    when a special file is refused."""
    from inferno.arguments import special_file

    special = special_file(path)
    if special is not None:
        raise InfernoError(f"{flag} {path} is {special}: give a regular file{or_else}")
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > limit:
                data = b""
            else:
                data = f.read(limit + 1)
                if len(data) <= limit:
                    return data.decode(encoding)
    except OSError as exc:
        raise InfernoError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InfernoError(f"{flag} {path} is not UTF-8 text (byte {exc.start})") from None
    raise InfernoError(f"{flag} {path} is more than the {_size(limit)} {what} may be")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
