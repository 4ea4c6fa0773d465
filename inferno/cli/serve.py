"""`model-serve [MODEL.gguf] [--host 127.0.0.1] [--port 8080]`: an OpenAI-compatible HTTP server.

One engine thread owns the model and a Scheduler (continuous batching, chunked prefill, the paged KV
cache's prefix sharing); uvicorn serves FastAPI's app on the main thread's event loop
(inferno.serve.app). SIGINT and SIGTERM end the requests in flight (their streams end with
finish_reason "abort") and the process exits 0 (130 after a Ctrl-C).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import sys
from collections.abc import Iterator
from time import perf_counter

import click

from inferno.arguments import shown_path
from inferno.cli.common import (
    EXIT_INTERRUPTED,
    check_activations,
    model_file,
    physical_memory,
    read_template,
    release_notes,
    run,
    script,
    set_threads,
    threads_option,
    version_option,
)
from inferno.cli.display import fmt_bytes
from inferno.errors import InfernoError
from inferno.kv import DEFAULT_DTYPE, DTYPES, LAYOUTS

PROG = "model-serve"
DEFAULT_CACHE_MEMORY = "1GiB"
DEFAULT_STEP_TOKENS = 256
DEFAULT_MAX_WAITING = 64
GRACEFUL_SHUTDOWN_S = 5  # after which uvicorn cancels a connection still open (the engine ended its request)


def say(message: str) -> None:
    click.echo(f"{PROG}: {message}", err=True)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use is a one-line error at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InfernoError(f"--host {host}: {exc.strerror}") from None
    except UnicodeError:  # the IDNA codec: a label over 63 characters, a lone surrogate...
        raise InfernoError(f"--host {ascii(host)[:80]} is not a valid host name or address") from None
    family, socket_type, proto, _, address = infos[0]
    sock = socket.socket(family, socket_type, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise InfernoError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", required=False, type=click.Path(dir_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (loopback by default; anything else is reachable by others).")
@click.option("--port", type=int, default=8080, show_default=True, help="Port (0: any free one).")
@click.option("--kv", default="paged", show_default=True, metavar="KIND",
              help=f"KV cache: {' | '.join(LAYOUTS)}. paged: one block pool all requests share, with prefix "
                   "caching; any other layout: a cache of its own per request.")
@click.option("--kv-dtype", default=DEFAULT_DTYPE, show_default=True, metavar="TYPE",
              help=f"Element type of the cache rows: {' | '.join(DTYPES)}.")
@click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per block (--kv paged).")
@click.option("--cache-memory", default=DEFAULT_CACHE_MEMORY, show_default=True, metavar="SIZE",
              help="Bytes of the block pool (--kv paged): 1GiB, 512MiB...; blocks = SIZE // bytes of a block "
                   "(kv-memcalc's arithmetic). Pages become resident as blocks are written.")
@click.option("--max-batch", type=int, default=8, show_default=True, help="Sequences per step.")
@click.option("--step-tokens", type=int, default=DEFAULT_STEP_TOKENS, show_default=True,
              help="Tokens per step over all sequences: a long prompt is prefilled in chunks beside the "
                   "decoding sequences instead of stalling them.")
@click.option("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, show_default=True,
              help="Requests queued behind the batch; past it a request gets 503 at once.")
@threads_option()
@click.option("--activations", default="f32", show_default=True, metavar="f32|int8",
              help="How quantized weights take activations (see model-generate --help).")
@click.option("--chat-template", "chat_template", type=click.Path(dir_okay=False), default=None,
              metavar="FILE", help="A Jinja chat template to use instead of the model's (or for a model "
                                   "without one).")
@click.option("--api-key", envvar="INFERNO_API_KEY", default=None, metavar="KEY",
              help="Require `Authorization: Bearer KEY` on /v1 (also $INFERNO_API_KEY).")
@click.option("--access-log", is_flag=True, help="Log every HTTP request (uvicorn's access log).")
@version_option()
def command(model, host, port, kv, kv_dtype, block_size, cache_memory, max_batch, step_tokens, max_waiting,
            threads, activations, chat_template, api_key, access_log):
    """Serve a GGUF model over the OpenAI API: /v1/models, /v1/completions, /v1/chat/completions, with
    /health and Prometheus /metrics."""
    from inferno.plan.memcalc import parse_size

    set_threads(threads)
    check_activations(activations)
    if kv not in LAYOUTS:
        raise InfernoError(f"unknown KV cache layout {kv!r} (valid: {', '.join(LAYOUTS)})")
    if kv_dtype not in DTYPES:
        raise InfernoError(f"unknown --kv-dtype {kv_dtype!r} (valid: {', '.join(DTYPES)})")
    for flag, value, least in (("--max-batch", max_batch, 1), ("--step-tokens", step_tokens, 1),
                               ("--block-size", block_size, 1), ("--max-waiting", max_waiting, 0)):
        if value < least:
            raise InfernoError(f"{flag} must be at least {least}, got {value}")
    if not 0 <= port <= 65535:
        raise InfernoError(f"--port must be from 0 to 65535, got {port}")
    memory = parse_size(cache_memory)
    total = physical_memory()
    if kv == "paged" and total is not None and memory > total:
        raise InfernoError(f"--cache-memory {cache_memory} is more than this machine's "
                           f"{total / 2**30:,.1f} GiB of memory")
    template = read_template(chat_template) if chat_template else None
    if api_key is not None and not api_key.strip():
        raise InfernoError("--api-key is empty")
    model_path = model_file(model)
    if not os.path.isfile(model_path):  # (os.path: a name too long is not a file, not an OSError)
        raise InfernoError(f"no model file at {shown_path(model_path)}")
    sock = bind(host, port)
    if not is_loopback(host) and api_key is None:
        say(f"warning: listening on {host} without --api-key: anyone who reaches it can use the model")

    from inferno.kv.pool import BlockPool, layer_groups
    from inferno.runtime.engine import Engine
    from inferno.serve.app import ServeConfig, create_app, model_id, render_chat
    from inferno.serve.engine_loop import EngineLoop
    from inferno.serve.metrics import ServerMetrics

    t0 = perf_counter()
    engine = Engine.load(model_path)
    engine.model.set_activations(activations)
    config = engine.config
    context = config.context_length
    if kv == "paged":
        if block_size > context:  # as model-generate: every request would hold one block, mostly empty
            raise InfernoError(f"--block-size {block_size:,} is more than the model's context of {context:,}")
        geometry = config.kv_geometry
        block_bytes = BlockPool.planned_block_nbytes(geometry, block_size, kv_dtype)
        blocks = memory // block_bytes
        if blocks < 1:
            raise InfernoError(f"--cache-memory {cache_memory} is less than one block of "
                               f"{block_bytes:,} bytes")
        scheduler = engine.scheduler("paged", kv_dtype, max_batch, step_tokens, pool_blocks=blocks,
                                     block_size=block_size, max_waiting=max_waiting)
        groups = len(layer_groups(geometry))
        max_sequence = min(context, blocks // groups * block_size)
        if max_sequence < 2:
            raise InfernoError(f"--cache-memory {cache_memory} holds {blocks} blocks: not one sequence of "
                               "two tokens")
        pool = scheduler.pool
        cache_line = (f"KV cache paged {kv_dtype}: {blocks:,} blocks of {block_size} tokens x "
                      f"{block_bytes:,} bytes = {fmt_bytes(pool.nbytes)} (--cache-memory {cache_memory})"
                      f", {blocks * block_size // groups:,} tokens in all; a request holds up to "
                      f"{max_sequence:,}")
    else:
        scheduler = engine.scheduler(kv, kv_dtype, max_batch, step_tokens, max_waiting=max_waiting)
        max_sequence = context
        cache_line = (f"KV cache {kv} {kv_dtype}: a cache of its own per request (prompt + max_tokens), "
                      f"no prefix sharing; --cache-memory does not apply")
    engine.ready_for(max_sequence)  # the long-prompt (BLAS) kernels, loaded now rather than in a request
    has_model_template = engine.tokenizer.has_chat_template
    if template is not None:
        try:
            render_chat(engine.tokenizer, template, [{"role": "user", "content": "hi"}])
        except InfernoError as exc:
            raise InfernoError(f"--chat-template {chat_template}: {exc}") from None
    name = model_id(model_path)
    serve_config = ServeConfig(name, max_sequence, config.vocab_size, template, has_model_template, api_key,
                               {model_path.stem, str(model_path)})
    metrics = ServerMetrics(name)
    loop = EngineLoop(scheduler, engine.tokenizer, metrics)
    app = create_app(loop, engine.tokenizer, metrics, serve_config)

    say(f"{name}: context {context:,} tokens, loaded in {perf_counter() - t0:.1f} s")
    say(cache_line)
    say(f"max batch {max_batch}, {step_tokens} tokens a step, up to {max_waiting} waiting; chat template: "
        + ("--chat-template" if template else "the model's" if has_model_template else "none (chat refused)"))
    listening = f"listening on {url_of(sock)} (OpenAI API under /v1)"
    listening += ", API key required" if api_key else ""

    def started() -> None:  # said once connections are accepted and SIGTERM/SIGINT stop the server
        release_notes()
        say(listening)

    server = _server(app, sock, access_log, loop, started)
    loop.start()
    try:
        server.run(sockets=[sock])
    finally:
        loop.stop()
    if server.signals and server.signals[0] == signal.SIGINT:
        say("interrupted: stopped")
        sys.exit(EXIT_INTERRUPTED)
    say("stopped")


def _server(app, sock: socket.socket, access_log: bool, engine_loop, started=lambda: None):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, whose first signal also ends the requests in flight (their streams end at
        once, so shutting down waits for nobody) and which does not raise the signal again when done."""

        signals: list[int]

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            self.signals = []
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                started()

        def handle_exit(self, sig: int, frame) -> None:
            self.signals.append(sig)
            engine_loop.request_stop()
            super().handle_exit(sig, frame)

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=access_log,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off")
    server = Server(config)
    server.signals = []
    return server


def main() -> None:
    run(command, PROG)


entry = script(main)  # the console script

if __name__ == "__main__":
    entry()
