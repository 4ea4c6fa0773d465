"""`model-generate [--kv MODE] [MODEL.gguf] PROMPT [MAX_NEW_TOKENS]`: generate text and show what it cost."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from time import perf_counter

import click
from rich.text import Text

from inferno.cli.common import (
    EXIT_INTERRUPTED,
    blame,
    console,
    default_model,
    looks_like_model,
    progress_on,
    run,
    set_threads,
    utf8,
    version_option,
)
from inferno.errors import InfernoError
from inferno.kv import KINDS

PROG = "model-generate"
DEFAULT_NEW_TOKENS = 32


def split_positionals(args: tuple[str, ...], prompt: str | None = None) -> tuple[Path | None, str, int]:
    """[MODEL.gguf] PROMPT [MAX_NEW_TOKENS] (PROMPT absent when it comes from --prompt-file).

    The first argument is the model when it looks like one or when every argument is present.
    """
    args = list(args)
    full = 2 if prompt is not None else 3
    model = Path(args.pop(0)) if args and (looks_like_model(args[0]) or len(args) == full) else None
    if prompt is None:
        if not args:
            raise click.UsageError("missing PROMPT")
        prompt = args.pop(0)
    if len(args) > 1:
        raise click.UsageError(f"too many arguments: {' '.join(args)}")
    if not args:
        return model, prompt, DEFAULT_NEW_TOKENS
    try:
        return model, prompt, int(args[0])
    except ValueError:
        raise click.UsageError(f"MAX_NEW_TOKENS must be a whole number, got {args[0]!r}") from None


def read_prompt_file(path: str) -> str:
    """The prompt in file `path`, or on standard input for `-`; it must be UTF-8."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
        return data.decode("utf-8")
    except OSError as exc:
        raise InfernoError(f"cannot read --prompt-file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InfernoError(f"--prompt-file {path} is not UTF-8 text (byte {exc.start})") from None


def _kv_alone_means_basic(argv: list[str]) -> list[str]:
    """`--kv` with no mode means basic: give it one when the next word is not a mode but a file or flag."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--kv":
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("-") or nxt.endswith(".gguf") or os.path.exists(nxt):
                out.append("basic")
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("args", nargs=-1, metavar="[MODEL.gguf] PROMPT [MAX_NEW_TOKENS]")
@click.option("--kv", "kv", default=None, metavar="MODE",
              help=f"KV cache: {' | '.join(KINDS)} (--kv alone: basic). Without it: no cache.")
@click.option("--max-context", type=int, default=None,
              help="Tokens the cache is sized for (default: prompt + new tokens; without --kv: prealloc).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--system", default=None, metavar="TEXT",
              help="With --chat: a system message before the prompt.")
@click.option("--stop", "stops", multiple=True, metavar="STRING",
              help="End generation where STRING appears (repeatable); the text ends before it.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 means greedy.")
@click.option("--top-k", type=int, default=0, help="Sample from the k most likely tokens (0: off).")
@click.option("--top-p", type=float, default=1.0, help="Sample from the smallest set of mass p.")
@click.option("--seed", type=int, default=None, help="Random seed for sampling.")
@click.option("--ignore-eos", is_flag=True, help="Generate all tokens even past end-of-sequence.")
@click.option("--prompt-file", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Read the prompt from a file, or standard input for - (PROMPT is then not given).")
@click.option("--threads", type=int, default=None, help="Threads for the kernels (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text and tables.")
@click.option("--save-cache", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="After the run, save the KV cache to FILE as a snapshot (without --kv: prealloc).")
@click.option("--load-cache", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Start from a snapshot: only the prompt past its tokens is prefilled.")
@version_option()
def command(args, kv, max_context, chat, system, stops, temperature, top_k, top_p, seed, ignore_eos,
            prompt_file, threads, as_json, save_cache, load_cache):
    """Generate text with a GGUF model on the CPU and report per-forward timings.

    The generated text goes to stdout; the prompt, progress and metrics to stderr (--json: one
    object on stdout). With a KV cache decode cost stays flat; without one every step reruns the
    whole sequence.
    """
    set_threads(threads)
    file_prompt = read_prompt_file(prompt_file) if prompt_file else None
    model_path, prompt, max_new = split_positionals(args, file_prompt)
    prompt = utf8("the prompt", prompt)
    stops = [utf8("--stop", stop) for stop in stops]
    if "" in stops:
        raise InfernoError("--stop needs a non-empty string")
    if system is not None:
        system = utf8("--system", system)
    if max_new < 1:
        raise InfernoError(f"MAX_NEW_TOKENS must be at least 1, got {max_new}")
    if kv is not None and kv not in KINDS:
        raise InfernoError(f"unknown KV cache mode {kv!r} (valid: {', '.join(KINDS)})")
    if max_context is not None and max_context < 1:
        raise InfernoError(f"--max-context must be at least 1, got {max_context}")
    if system is not None and not chat:
        raise InfernoError("--system needs --chat (the system message goes into the chat template)")
    if save_cache and load_cache and Path(save_cache).resolve() == Path(load_cache).resolve():
        raise InfernoError("--save-cache names the --load-cache file, which is never modified: give another")
    if (save_cache or load_cache or max_context) and kv is None:
        kv = "prealloc"  # a snapshot is a cache's contents, a context is a cache's size: there must be one
    from inferno.sampling import Sampler

    sampler = Sampler(temperature, top_k, top_p, seed)
    model_path = model_path or default_model()

    from inferno.engine import Engine
    from inferno.generate import Generation
    from inferno.metrics import Metrics
    from inferno.output_text import OutputText
    from inferno.snapshot import Snapshot

    err = console(stderr=True)
    engine = Engine.load(model_path, progress=None if as_json else progress_on(err))
    output = OutputText(engine.tokenizer, stops)
    text = engine.prompt_text(prompt, chat, system)
    prompt_ids = engine.tokenizer.encode(text)
    with blame("--max-context", max_context):
        cache = engine.make_cache(kv, len(prompt_ids), max_new, max_context)
    load_cache_ms = None
    if load_cache:
        t = perf_counter()
        snapshot = Snapshot.load(load_cache)
        snapshot.check_model(engine.config, engine.fingerprint)
        snapshot.restore(cache, prompt_ids)
        load_cache_ms = (perf_counter() - t) * 1000

    if not as_json and sys.stdout.isatty():
        # Someone watching the text stream sees it follow the prompt; a script reading stdout gets
        # only the generated text. Text, not a str: the prompt is never read as rich markup.
        err.print(Text(prompt, style="dim"), end="", soft_wrap=True)
    generation = None
    t0 = perf_counter()
    try:
        steps = engine.start_text(prompt_ids, max_new, output, kv=kv, sampler=sampler, cache=cache,
                                  ignore_eos=ignore_eos)
        for generation, piece in steps:  # noqa: B007 (the last one is recorded below)
            show(piece, as_json)
    except KeyboardInterrupt:
        generation = generation or Generation(prompt_ids, [], Metrics(len(prompt_ids), 0))
        generation.finish_reason = "interrupted"
    show(output.flush(), as_json)
    record = engine.record(generation, text, (perf_counter() - t0) * 1000, load_cache_ms, output)
    if save_cache and record.finish_reason != "interrupted":
        Snapshot.from_cache(cache, prompt_ids + generation.token_ids, engine.config, engine.fingerprint).save(
            save_cache
        )
    interrupted = record.finish_reason == "interrupted"
    if as_json:
        json.dump(record.to_json(), sys.stdout)
    print(flush=True)
    if interrupted:
        click.echo(f"{PROG}: interrupted after {len(generation.token_ids)} tokens", err=True)
    if not as_json:
        from inferno.cli.display import metrics_panel

        err.print(metrics_panel(record))
    if interrupted:
        sys.exit(EXIT_INTERRUPTED)


def show(piece: str, as_json: bool) -> None:
    """Stream generated text to stdout as it comes (in --json mode it is only in the object)."""
    if piece and not as_json:
        print(piece, end="", flush=True)


def main() -> None:
    sys.argv[1:] = _kv_alone_means_basic(sys.argv[1:])
    run(command, PROG)


if __name__ == "__main__":
    main()
