"""What every inferno command shares: one-line errors with exit code 2, consoles, threads."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import click

from inferno.errors import InfernoError

EXIT_BAD_INPUT = 2


def fail(prog: str, message: str) -> NoReturn:
    first_line = message.strip().splitlines()[0] if message.strip() else "failed"
    click.echo(f"{prog}: error: {first_line}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def run(command: click.Command, prog: str) -> None:
    """Run a click command; bad flags and InfernoError become one line on stderr and exit code 2."""
    try:
        command.main(prog_name=prog, standalone_mode=False)
    except click.exceptions.Exit as done:
        sys.exit(done.exit_code)
    except click.ClickException as bad:
        fail(prog, bad.format_message())
    except InfernoError as bad:
        fail(prog, str(bad))
    except click.Abort:
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo(f"{prog}: interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as Unix tools do.
        sys.stderr.close()
        sys.exit(0)


SPIN_COUNT = "1000"  # busy-wait iterations (a few microseconds) before an idle worker sleeps


def set_threads(threads: int | None) -> None:
    """Cap every thread pool we use (Numba's and the BLAS behind numpy) at `threads`.

    Must run before numpy is imported for the BLAS limits to take effect. Idle OpenMP workers spin
    only briefly before sleeping: a decode step launches over a hundred parallel loops microseconds apart, so
    sleeping at once (OMP_WAIT_POLICY=PASSIVE) made decode 1.4x slower on a quiet machine, while
    libgomp's default long spin made it up to 10x slower when other processes wanted the cores.
    """
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    if threads is None:
        return
    if threads < 1:
        raise InfernoError(f"--threads must be at least 1, got {threads}")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    import numba

    available = numba.config.NUMBA_NUM_THREADS
    if threads > available:
        raise InfernoError(f"--threads {threads} is more than the {available} this machine has")
    numba.set_num_threads(threads)


def console(stderr: bool = False):
    """A rich console; rich itself honours NO_COLOR and drops styling when not writing to a terminal."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)
