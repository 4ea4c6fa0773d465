"""`model-chat`: a conversation in a loop, its history kept in the KV cache between turns.

Each turn renders the whole conversation with the chat template, keeps the cached positions its
tokens share with what the cache holds (every earlier turn, as a rule) and computes only the rest:
the plainest way to see a cache at work. Lines come from the terminal or a pipe (one user turn a
line); answers stream to stdout, everything else to stderr.

    /reset        forget the conversation (and the cache)
    /save FILE    save the cache as a snapshot (kv-inspect and --load-cache read it)
    /stats        cache bytes, tokens reused and computed this turn, time to first token
    Ctrl-C        stops the answer, not the session; Ctrl-D (end of input) leaves
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from time import perf_counter

import click

from inferno.cli.common import (
    EXIT_INTERRUPTED,
    check_activations,
    console,
    model_file,
    progress_on,
    read_template,
    release_notes,
    run,
    script,
    set_threads,
    threads_option,
    utf8,
    version_option,
)
from inferno.errors import InfernoError
from inferno.kv import DEFAULT_DTYPE, DTYPES, LAYOUTS

PROG = "model-chat"
MAX_LINE = 16 * 2**20  # characters of one line of input (model-generate's --prompt-file limit)
COMMANDS = ("/reset", "/save FILE", "/stats")


@dataclass
class Conversation:
    """The turns so far and the tokens whose K/V the cache holds, in order."""

    system: str | None
    messages: list[dict[str, str]] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # token ids of the cache's positions 0 .. length - 1
    last: dict = field(default_factory=dict)  # the last turn's figures (/stats)

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.held = []
        self.last = {}


def turn(engine, cache, conversation: Conversation, text: str, max_new: int, sampler,
         template: str | None, out) -> None:
    """One user turn: its answer streamed to `out`, the conversation and cache advanced."""
    from inferno.runtime.scheduler import Request, Scheduler

    conversation.messages.append({"role": "user", "content": text})
    prompt = engine.tokenizer.apply_chat_template(conversation.messages, template=template)
    try:
        ids = engine.tokenizer.encode(prompt, cache.capacity)
    except InfernoError:
        conversation.messages.pop()
        raise InfernoError(f"the conversation is longer than the cache of {cache.capacity} tokens: /reset "
                           "starts over") from None
    if not ids:
        conversation.messages.pop()
        raise InfernoError("the chat template rendered the conversation as no tokens: nothing to answer")
    shared = 0
    for a, b in zip(ids, conversation.held, strict=False):
        if a != b:
            break
        shared += 1
    kept = cache.truncate(min(shared, len(ids) - 1, cache.length))  # the last prompt token gives logits
    room = cache.capacity - len(ids)
    if room < 1:
        conversation.messages.pop()
        raise InfernoError(f"the conversation ({len(ids)} tokens) fills the cache of {cache.capacity}: "
                           "/reset starts over")
    engine.ready_for(len(ids) - kept)  # a long turn's kernels load before its time to first token
    scheduler = Scheduler(engine.model, engine.tokenizer)
    rid = scheduler.add(Request(ids, min(max_new, room), sampler, keep_cache=True, cache=cache))
    t0 = perf_counter()
    try:
        while scheduler.has_work:
            for event in scheduler.step():
                if event.error is not None:
                    raise InfernoError(event.error)
                out.write(event.text)
                out.flush()
    except KeyboardInterrupt:
        scheduler.abort(rid)
        out.write(scheduler.get(rid).output.flush())
        click.echo("\n[answer stopped]", err=True)
    generation = scheduler.get(rid)
    out.write("\n")
    out.flush()
    cache.truncate(min(cache.length, generation.computed))  # an interrupted forward leaves no half rows
    conversation.held = generation.tokens[: cache.length]
    conversation.messages.append({"role": "assistant", "content": generation.output.text})
    m = generation.metrics
    conversation.last = {"reused_tokens": kept, "computed_tokens": len(ids) - kept,
                         "generated_tokens": m.generated_tokens, "ttft_ms": m.ttft_ms,
                         "decode_tok_s": m.decode_tok_s, "wall_s": perf_counter() - t0}


def stats_line(cache, conversation: Conversation) -> str:
    from inferno.cli.display import fmt_bytes

    last = conversation.last
    if not last:
        return f"cache {cache.layout} {cache.dtype.name}: {cache.length} tokens, {fmt_bytes(cache.nbytes)}"
    rate = f"{last['decode_tok_s']:.1f} tok/s" if last["decode_tok_s"] else "-"
    return (f"cache {cache.layout} {cache.dtype.name}: {cache.length} of {cache.capacity} tokens, "
            f"{fmt_bytes(cache.nbytes)}; last turn: {last['reused_tokens']} tokens reused from the cache, "
            f"{last['computed_tokens']} computed, {last['generated_tokens']} generated, "
            f"TTFT {last['ttft_ms']:.1f} ms, decode {rate}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", required=False, type=click.Path(dir_okay=False))
@click.option("--system", default=None, metavar="TEXT", help="A system message before the conversation.")
@click.option("--chat-template", "template_file", type=click.Path(dir_okay=False), default=None,
              metavar="FILE", help="A Jinja chat template instead of the model's (a base model has none).")
@click.option("-n", "--max-tokens", "max_new", type=int, default=256, show_default=True,
              help="Most tokens an answer may take.")
@click.option("--kv", default="prealloc", show_default=True, type=click.Choice(["basic", "prealloc"]),
              help="The cache holding the conversation (layouts that can forget a turn's end).")
@click.option("--kv-dtype", default=DEFAULT_DTYPE, show_default=True, metavar="TYPE",
              help=f"Element type of the cache rows: {' | '.join(DTYPES)}.")
@click.option("--max-context", type=int, default=None,
              help="Tokens the conversation may hold (default: the model's context).")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 means greedy.")
@click.option("--top-k", type=int, default=0, help="Sample from the k most likely tokens (0: off).")
@click.option("--top-p", type=float, default=1.0, help="Sample from the smallest set of mass p.")
@click.option("--seed", type=int, default=None, help="Random seed for sampling.")
@threads_option()
@click.option("--activations", default="f32", show_default=True, metavar="f32|int8")
@version_option()
def command(model, system, template_file, max_new, kv, kv_dtype, max_context, temperature, top_k, top_p, seed,
            threads, activations):
    """Chat with a GGUF model; each turn reuses the earlier turns' KV cache.

    \b
    One user turn per line (terminal or pipe). /reset, /save FILE, /stats; Ctrl-C stops an answer,
    Ctrl-D leaves.
    """
    set_threads(threads)
    check_activations(activations)
    if max_new < 1:
        raise InfernoError(f"--max-tokens must be at least 1, got {max_new}")
    if kv not in LAYOUTS:
        raise InfernoError(f"unknown KV cache mode {kv!r}")
    template = read_template(template_file) if template_file else None
    system = utf8("--system", system) if system is not None else None
    from inferno.model.sampling import Sampler
    from inferno.runtime.engine import Engine

    err = console(stderr=True)
    engine = Engine.load(model_file(model), progress=progress_on(err))
    engine.model.set_activations(activations)
    sampler = Sampler(temperature, top_k, top_p, seed)
    conversation = Conversation(system)
    conversation.reset()
    probe = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], template=template)
    if not engine.tokenizer.encode(probe):  # (a model without a template is refused by the call itself)
        source = f"--chat-template {template_file}" if template_file else "the model's chat template"
        raise InfernoError(f"{source} renders a user message as no tokens: nothing to answer")
    context = min(max_context or engine.config.context_length, engine.config.context_length)
    cache = engine.make_cache(kv, 1, context - 1, context, kv_dtype)
    release_notes()  # the session has begun
    interactive = sys.stdin.isatty()
    if interactive:
        err.print(f"chatting with {engine.path} ({', '.join(COMMANDS)}; Ctrl-D leaves)", style="dim")
    while True:
        if interactive:
            click.echo("> ", nl=False, err=True)
        try:
            line = sys.stdin.readline(MAX_LINE + 1)
        except KeyboardInterrupt:
            click.echo("", err=True)
            continue
        if not line:
            break
        if len(line) > MAX_LINE:  # `cat /dev/zero |`: a line that never ends is not read to its end
            raise InfernoError(f"a line of standard input is more than the {MAX_LINE >> 20} MiB a message "
                               "may be")
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() == "/reset":
            conversation.reset()
            cache.reset()
            click.echo("[conversation reset]", err=True)
        elif text.strip() == "/stats":
            click.echo(stats_line(cache, conversation), err=True)
        elif text.startswith("/save"):
            save(engine, cache, conversation, text[len("/save"):].strip())
        else:
            try:
                turn(engine, cache, conversation, utf8("the message", text), max_new, sampler, template,
                     sys.stdout)
            except InfernoError as exc:
                click.echo(f"{PROG}: {exc}", err=True)


def save(engine, cache, conversation: Conversation, path: str) -> None:
    from inferno.kv.snapshot import Snapshot

    if not path:
        click.echo(f"{PROG}: /save needs a file name", err=True)
        return
    try:
        Snapshot.from_cache(cache, conversation.held, engine.config, engine.fingerprint).save(path)
    except (InfernoError, OSError) as exc:
        click.echo(f"{PROG}: {exc}", err=True)
        return
    click.echo(f"[saved {cache.length} tokens to {path}]", err=True)


def main() -> None:
    try:
        run(command, PROG)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)


entry = script(main)

if __name__ == "__main__":
    entry()
