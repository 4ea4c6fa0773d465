"""`model-generate [--kv MODE] [MODEL.gguf] PROMPT [MAX_NEW_TOKENS]`: generate text and show what it cost."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from time import perf_counter

import click
from rich.text import Text

import inferno
from inferno.cli.common import (
    EXIT_INTERRUPTED,
    blame,
    check_activations,
    console,
    looks_like_model,
    model_file,
    progress_on,
    quiet_option,
    read_template,
    read_text_file,
    release_notes,
    require_stdout,
    run,
    script,
    set_threads,
    threads_option,
    utf8,
    version_option,
)
from inferno.errors import InfernoError
from inferno.kv import DEFAULT_DTYPE, DTYPES, LAYOUTS
from inferno.kv.window import POSITIONS

PROG = "model-generate"
DEFAULT_NEW_TOKENS = 32
LONG_PREFILL = 512  # prompt tokens past which a spinner shows the prefill going on


def split_positionals(args: tuple[str, ...], prompt: str | None = None) -> tuple[str | None, str, int | None]:
    """[MODEL.gguf] PROMPT [MAX_NEW_TOKENS] (PROMPT absent when it comes from --prompt-file); the count
    is None when not given.

    The first argument is the model when it looks like one (a .gguf, a GGUF file, a model name such as
    smollm2) or when every argument is present.
    """
    args = list(args)
    full = 2 if prompt is not None else 3
    model = args.pop(0) if args and (looks_like_model(args[0]) or len(args) == full) else None
    if prompt is None:
        if not args:
            raise click.UsageError("missing PROMPT (for a conversation: model-chat [MODEL])")
        prompt = args.pop(0)
    if len(args) > 1:
        raise click.UsageError(f"too many arguments: {' '.join(args)}")
    if not args:
        return model, prompt, None
    try:
        return model, prompt, int(args[0])
    except ValueError:
        raise click.UsageError(f"MAX_NEW_TOKENS must be a whole number, got {args[0]!r}") from None


PROMPT_FILE_LIMIT = 16 * 2**20  # bytes: past any context inferno runs (1M tokens x 16 bytes)
MAX_NEW_TOKENS = 2**24  # a run's bookkeeping grows with its tokens; more than this never ends in practice
MAX_SEQUENCES = 4096  # --num-samples and --max-batch: sequences decoded together at most


def read_prompt_file(path: str, limit: int = PROMPT_FILE_LIMIT) -> str:
    """The prompt in file `path`, or on standard input for `-`; it must be UTF-8 and at most `limit`
    bytes (read no further: /dev/zero is refused at once). A FIFO other than `-` is refused: one that
    nobody writes to would block the open forever."""
    if path != "-":
        return read_text_file("--prompt-file", path, limit, "a prompt", or_else=", or - with the pipe on "
                              "standard input")
    if sys.stdin is None:
        raise InfernoError("--prompt-file -: standard input is closed")
    try:
        data = sys.stdin.buffer.read(limit + 1)
    except OSError as exc:
        raise InfernoError(f"cannot read --prompt-file -: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise InfernoError(f"--prompt-file - is more than the {limit // 2**20} MiB a prompt may be")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InfernoError(f"--prompt-file - is not UTF-8 text (byte {exc.start})") from None


def cache_options(window: int | None, sinks: int | None, positions: str | None) -> dict:
    """The window layout's options given on the command line (those not given keep their defaults)."""
    given = {"window": window, "sinks": sinks, "positions": positions}
    return {name: value for name, value in given.items() if value is not None}


def _optional_values(argv: list[str]) -> list[str]:
    """Flags whose value may be left out, so that no prompt or count is taken for their value:

    `--kv MODE` takes the next word only when it is a cache mode (or a near miss such as `pages`, refused
    as one); else `--kv` alone means basic (`--kv "Once upon a time" 8` keeps the prompt). `--kv=MODE`
    always works. `--log-tokens` alone logs no alternatives; `--log-tokens=K` the K likeliest: a bare
    number after it is MAX_NEW_TOKENS (`model-generate PROMPT --log-tokens 4`)."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":  # the rest are positionals
            return out + argv[i:]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if arg == "--kv" and not (nxt in LAYOUTS or _near_mode(nxt)):
            arg = "--kv=basic"
        if arg == "--log-tokens":
            arg = "--log-tokens=0"
        out.append(arg)
    return out


def _near_mode(word: str | None) -> bool:
    """A lowercase word one typo away from a cache mode (`pages`): a mistaken mode, not a prompt."""
    import difflib

    if word is None or not word.isalpha() or not word.islower() or os.path.exists(word):
        return False
    return bool(difflib.get_close_matches(word, LAYOUTS, n=1, cutoff=0.8))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("args", nargs=-1, metavar="[MODEL.gguf|smollm2|gemma3] PROMPT [MAX_NEW_TOKENS]")
@click.option("--max-tokens", "-n", "max_tokens", type=int, default=None, metavar="N",
              help=f"New tokens at most, as MAX_NEW_TOKENS  [default: {DEFAULT_NEW_TOKENS}]")
@click.option("--kv", "kv", default=None, metavar="MODE",
              help=f"KV cache: {' | '.join(LAYOUTS)} (--kv alone, or followed by anything but a mode: "
                   "basic; --kv=MODE always a mode). Without it: no cache.")
@click.option("--kv-dtype", default=DEFAULT_DTYPE, show_default=True, metavar="TYPE",
              help=f"Element type of the cache rows: {' | '.join(DTYPES)}.")
@click.option("--max-context", type=int, default=None,
              help="Tokens the cache is sized for (default: prompt + new tokens; without --kv: prealloc).")
@click.option("--block-size", type=int, default=None,
              help="Tokens per block of --kv paged (default: 16).")
@click.option("--num-samples", type=int, default=None, metavar="N",
              help="N continuations of the prompt, run together (seed + i each; --kv paged, the default "
                   "here: its full blocks computed once).")
@click.option("--batch", "batch_file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Prompts of FILE (one a line, or JSON lines with per-prompt options), decoded together.")
@click.option("--max-batch", type=int, default=16, show_default=True,
              help="With --batch: sequences run together at most.")
@click.option("--window", type=int, default=None, metavar="W",
              help="--kv window: positions a sliding layer attends to (all layers, if the model sets none).")
@click.option("--sinks", type=int, default=None, metavar="S",
              help="--kv window: first positions always kept (attention sinks)  [default: 4]")
@click.option("--window-positions", type=click.Choice(POSITIONS), default=None,
              help="--kv window: positions of keys once the window slides: shift (as if contiguous) or "
                   "original  [default: shift]")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--system", default=None, metavar="TEXT",
              help="With --chat: a system message before the prompt.")
@click.option("--chat-template", "template_file", type=click.Path(dir_okay=False), default=None,
              metavar="FILE", help="With --chat: a Jinja chat template instead of the model's (a base "
                                   "model has none).")
@click.option("--stop", "stops", multiple=True, metavar="STRING",
              help="End generation where STRING appears (repeatable); the text ends before it.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 means greedy.")
@click.option("--top-k", type=int, default=0, help="Sample from the k most likely tokens (0: off).")
@click.option("--top-p", type=float, default=1.0, help="Sample from the smallest set of mass p.")
@click.option("--seed", type=int, default=None, help="Random seed for sampling.")
@click.option("--ignore-eos", is_flag=True, help="Generate all tokens even past end-of-sequence.")
@click.option("--prompt-file", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Read the prompt from a file, or standard input for - (PROMPT is then not given).")
@threads_option()
@click.option("--activations", default="f32", show_default=True, metavar="f32|int8",
              help="How quantized weights take activations: f32 keeps the float reference's tokens; int8 "
                   "rounds them as llama.cpp does (faster batches; kv-bench --fidelity measures it).")
@click.option("--log-tokens", "log_tokens", type=int, default=None, metavar="[=K]",
              help="Log every forward: token, its probability (and with --log-tokens=K the K likeliest), "
                   "ms, cache length. A bare number after --log-tokens is MAX_NEW_TOKENS.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text and tables.")
@click.option("--save-cache", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="After the run, save the KV cache to FILE as a snapshot (without --kv: prealloc). FILE is "
                   "absent or a regular file (a symlink, FIFO, device or directory is refused before the "
                   "run); Ctrl-C (exit 130) or SIGTERM (exit 143) leaves no file behind.")
@click.option("--load-cache", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Start from a snapshot: only the prompt past its tokens is prefilled.")
@quiet_option()
@version_option()
def command(args, max_tokens, kv, kv_dtype, max_context, block_size, num_samples, batch_file, max_batch,
            window, sinks, window_positions, chat, system, template_file, stops, temperature, top_k, top_p,
            seed, ignore_eos, prompt_file, threads, activations, log_tokens, as_json, save_cache, load_cache,
            quiet):
    """Generate text with a GGUF model on the CPU and report per-forward timings.

    The generated text goes to stdout; the prompt, progress and metrics to stderr (--json: one
    object on stdout). With a KV cache decode cost stays flat; without one every step reruns the
    whole sequence.
    """
    require_stdout()  # `>&-`: refused before loading anything
    set_threads(threads)
    many = num_samples is not None or batch_file is not None
    if many:
        kv = _check_many(kv, num_samples, batch_file, max_batch, prompt_file,
                         max_context is not None or bool(save_cache or load_cache), log_tokens is not None)
    file_prompt = read_prompt_file(prompt_file) if prompt_file else None
    if batch_file:
        file_prompt = ""  # the prompts come from the file
    model_path, prompt, max_new = split_positionals(args, file_prompt)
    if max_tokens is not None and max_new is not None and max_tokens != max_new:
        raise InfernoError(f"-n/--max-tokens {max_tokens} and MAX_NEW_TOKENS {max_new} differ: give one")
    max_new = next((n for n in (max_tokens, max_new) if n is not None), DEFAULT_NEW_TOKENS)
    prompt = utf8("the prompt", prompt)
    stops = [utf8("--stop", stop) for stop in stops]
    if "" in stops:
        raise InfernoError("--stop needs a non-empty string")
    if system is not None:
        system = utf8("--system", system)
    if max_new < 1:
        raise InfernoError(f"MAX_NEW_TOKENS must be at least 1, got {max_new}")
    if max_new > MAX_NEW_TOKENS:
        raise InfernoError(f"MAX_NEW_TOKENS {max_new:,} is more than the {MAX_NEW_TOKENS:,} a run can take")
    check_activations(activations)
    if kv is not None and kv not in LAYOUTS:
        raise InfernoError(f"unknown KV cache mode {kv!r} (valid: {', '.join(LAYOUTS)})")
    if log_tokens is not None and log_tokens < 0:
        raise InfernoError(f"--log-tokens takes a count of alternatives, 0 or more; got {log_tokens}")
    if max_context is not None and max_context < 1:
        raise InfernoError(f"--max-context must be at least 1, got {max_context}")
    if system is not None and not chat:
        raise InfernoError("--system needs --chat (the system message goes into the chat template)")
    template = read_template(template_file) if template_file else None
    if template is not None and not chat:
        raise InfernoError("--chat-template needs --chat")
    if block_size is not None and (kv != "paged" or block_size < 1):
        raise InfernoError(f"--block-size needs --kv paged and at least 1 token, got {block_size}")
    window_options = cache_options(window, sinks, window_positions)
    if window_options and (kv is None or kv not in LAYOUTS or not LAYOUTS[kv].evicts):
        raise InfernoError("--window, --sinks and --window-positions apply to --kv window")
    if save_cache and load_cache and os.path.realpath(save_cache) == os.path.realpath(load_cache):
        raise InfernoError("--save-cache names the --load-cache file, which is never modified: give another")
    if save_cache:
        from inferno.kv.snapshot import check_save_path

        check_save_path(save_cache)  # a symlink, FIFO, device or directory: refused before any work
    if (save_cache or load_cache or max_context or kv_dtype != DEFAULT_DTYPE) and kv is None:
        # a snapshot is a cache's contents, a context a cache's size, an element type a cache's rows
        kv = "prealloc"
    from inferno.model.sampling import Sampler

    sampler = Sampler(temperature, top_k, top_p, seed)
    model_path = model_file(model_path)

    from inferno.kv.snapshot import Snapshot
    from inferno.runtime.engine import Engine
    from inferno.runtime.metrics import Metrics
    from inferno.runtime.scheduler import Generation, Request
    from inferno.text.output_text import OutputText

    err = console(stderr=True)
    err.quiet = quiet  # --quiet: no progress, no metrics, no prompt echo on stderr
    imports_ms = (perf_counter() - inferno.IMPORTED_AT) * 1000
    engine = Engine.load(model_path, progress=None if as_json or quiet else progress_on(err))
    engine.startup = replace(engine.startup, imports_ms=imports_ms)
    engine.model.set_activations(activations)
    if template is not None:
        engine.tokenizer.use_chat_template(template)
    check_bounds(engine, prompt, chat, system, max_new, num_samples, max_batch if batch_file else None,
                 block_size, kv, kv_dtype)
    if many:
        from inferno.cli import generate_many

        defaults = generate_many.Defaults(max_new, temperature, top_k, top_p, seed, ignore_eos, chat, stops,
                                          system)
        options = window_options | ({"block_size": block_size} if block_size else {})
        cache = generate_many.Cache(kv, kv_dtype, options)
        if batch_file:
            generate_many.run_batch(engine, batch_file, defaults, cache, max_batch, as_json, quiet)
        else:
            generate_many.run_samples(engine, prompt, num_samples, defaults, cache, as_json, quiet)
        return
    text = engine.prompt_text(prompt, chat, system)
    prompt_ids = engine.tokenizer.encode(text, prompt_context(engine, kv))
    with blame("--max-context", max_context):
        options = window_options | ({"block_size": block_size} if block_size else {})
        cache = engine.make_cache(kv, len(prompt_ids), max_new, max_context, kv_dtype, **options)
    load_cache_ms = None
    if load_cache:
        t = perf_counter()
        snapshot = Snapshot.load(load_cache, (engine.config, engine.fingerprint))  # model checked first
        snapshot.check_model(engine.config, engine.fingerprint)
        snapshot.restore(cache, prompt_ids)
        load_cache_ms = (perf_counter() - t) * 1000

    from inferno.analysis.token_log import TokenLog

    if not as_json and sys.stdout.isatty():
        # Someone watching the text stream sees it follow the prompt; a script reading stdout gets
        # only the generated text. Text, not a str: the prompt is never read as rich markup.
        err.print(Text(prompt, style="dim"), end="" if log_tokens is None else "\n", soft_wrap=True)
    log = TokenLog(engine.tokenizer, cache, log_tokens) if log_tokens is not None else None
    quiet = as_json or log is not None  # with the log on stderr, the text comes after it
    generation = None
    to_prefill = len(prompt_ids) - (cache.length if cache is not None else 0)
    spinner = None
    if not as_json and not err.quiet and to_prefill > LONG_PREFILL:
        spinner = err.status(f"prefilling {to_prefill:,} prompt tokens")
        spinner.start()
    t0 = perf_counter()
    try:
        steps = engine.start(prompt_ids, max_new, kv=kv, sampler=sampler, cache=cache, ignore_eos=ignore_eos,
                             stop=stops)
        for generation, piece in steps:
            if spinner is not None:
                spinner.stop()
                spinner = None
            if log is not None:
                entry = log.add(generation)
                if not as_json:
                    click.echo(entry.line(), err=True)  # plain: a log line is never wrapped or styled
            show(piece, quiet)
    except KeyboardInterrupt:
        generation = generation or Generation(-1, Request(prompt_ids, max_new), OutputText(engine.tokenizer),
                                              Metrics(len(prompt_ids), 0))
        generation.finish_reason = "interrupted"
    finally:
        if spinner is not None:
            spinner.stop()
    show(generation.output.flush(), quiet)
    record = engine.record(generation, text, (perf_counter() - t0) * 1000, load_cache_ms)
    record.token_log = log.records if log is not None else None
    if log is not None and not as_json:
        show(record.text, as_json)
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

        err.print(metrics_panel(record, err.width))
    if interrupted:
        sys.exit(EXIT_INTERRUPTED)


def prompt_context(engine, kv: str | None) -> int | None:
    """The most tokens a prompt may be: the model's context, unless a cache that evicts takes it (None)."""
    return None if kv is not None and kv in LAYOUTS and LAYOUTS[kv].evicts else engine.config.context_length


def check_bounds(engine, prompt: str, chat: bool, system: str | None, max_new: int, num_samples: int | None,
                 max_batch: int | None, block_size: int | None, kv: str | None, kv_dtype: str) -> None:
    """What the model's context and the machine's memory can hold, checked before any work: a block
    no longer than the context; N sequences of the prompt and their new tokens within RAM."""
    from inferno.cli.common import check_memory
    from inferno.kv import planned_nbytes

    context = engine.config.context_length
    if block_size is not None and block_size > context:
        raise InfernoError(f"--block-size {block_size:,} is more than the model's context of {context:,}")
    sequences = num_samples or max_batch
    if sequences is None:
        return
    flag = "--num-samples" if num_samples else "--max-batch"
    if sequences > MAX_SEQUENCES:
        raise InfernoError(f"{flag} {sequences:,} is more than the {MAX_SEQUENCES:,} sequences a run decodes "
                           "together")
    if num_samples:  # the prompt's length is known: each sample holds it and its new tokens
        prompt_tokens = len(engine.tokenizer.encode(engine.prompt_text(prompt, chat, system),
                                                    prompt_context(engine, kv)))
        if prompt_tokens > context:
            raise InfernoError(f"prompt of {prompt_tokens:,} tokens is longer than the model's context of "
                               f"{context:,}")
    else:  # --batch: at least one prompt token each
        prompt_tokens = 1
    tokens = min(prompt_tokens + max_new, context)
    if kv in (None, "paged"):
        size = block_size or 16
        tokens = -(-tokens // size) * size
    try:
        per_token = planned_nbytes("prealloc", engine.config.kv_geometry, 1, kv_dtype)
    except InfernoError:
        per_token = engine.config.kv_geometry.nbytes(1, 4)
    check_memory(f"{flag} {sequences:,} sequences of {tokens:,} tokens", sequences * tokens * per_token)


def show(piece: str, as_json: bool) -> None:
    """Stream generated text to stdout as it comes (in --json mode it is only in the object)."""
    release_notes()  # the run has begun: a note held from the start-up is now worth reading
    if piece and not as_json:
        print(piece, end="", flush=True)


def _check_many(kv: str | None, num_samples: int | None, batch_file: str | None, max_batch: int,
                prompt_file: str | None, single_only: bool, log_tokens: bool) -> str:
    """--num-samples and --batch run in a cache of any layout (paged by default: one block pool they
    share); the layout, or a one-line refusal."""
    if num_samples is not None and batch_file is not None:
        raise InfernoError("--num-samples and --batch do not go together: give one")
    if num_samples is not None and num_samples < 1:
        raise InfernoError(f"--num-samples must be at least 1, got {num_samples}")
    if max_batch < 1:
        raise InfernoError(f"--max-batch must be at least 1, got {max_batch}")
    if log_tokens:
        raise InfernoError("--log-tokens logs one sequence's forwards: not with --num-samples or --batch")
    if batch_file and prompt_file:
        raise InfernoError("--batch reads the prompts: --prompt-file does not go with it")
    if single_only:
        raise InfernoError("--max-context, --save-cache and --load-cache are for one sequence, "
                           "not --num-samples or --batch")
    return kv or "paged"


def main() -> None:
    sys.argv[1:] = _optional_values(sys.argv[1:])
    run(command, PROG)


entry = script(main)  # the console script

if __name__ == "__main__":
    entry()
