"""Load on an OpenAI-compatible server: N concurrent streaming clients.

    python -m inferno.bench.serve --url http://127.0.0.1:8080 --clients 8 --requests 16 --max-tokens 64

Every request is a streaming chat completion that shares one system prompt of about --system-words words
(what a prefix cache can hold once) followed by a distinct user question. Reported: aggregate output
tokens per second (all output tokens over the wall time of the run), time to first token and time per
output token (p50, p99), errors, and the prefix-cache hit ratio (cached / prompt tokens from each
response's usage.prompt_tokens_details, when the server reports it). --json prints one object.

With --prefix-reuse it sends two requests one after the other instead, sharing the system prompt
(make it long: --system-words 750 is about 1,000 tokens), and reports each one's time to first token
and cached tokens: how much a prefix cache saves the second.

Only loopback servers are measured (this is a benchmark, not a load generator for someone else's host),
and the run is bounded by --timeout seconds in all.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import httpx

FACTS = ("the library opens at nine on weekdays and at ten on saturdays it closes on sundays and public "
         "holidays members may borrow up to twelve books for three weeks and renew them twice online or at "
         "the front desk late returns cost twenty cents a day per book up to the price of the book the "
         "reading room is quiet and has desks with power outlets printing costs ten cents a page in black "
         "and fifty in colour the childrens corner has story time on wednesday mornings and the catalogue "
         "lists every book audio book and film with its shelf and whether it is on loan")
QUESTIONS = (
    "When does the library open on Saturdays?", "How many books can I borrow at once?",
    "What does printing in colour cost?", "Is the library open on public holidays?",
    "How long can I keep a book?", "When is story time for children?", "Can I renew a loan online?",
    "What is the late fee for one book?", "Does the reading room have power outlets?",
    "How do I know whether a film is on loan?", "Can I print in black and white?",
    "How many times can I renew a book?", "Is there a quiet place to study?",
    "What time does the library close on Sundays?", "Where do I find the shelf of a book?",
    "Are audio books in the catalogue?",
)


def system_prompt(words: int) -> str:
    vocabulary = FACTS.split()
    text = " ".join(vocabulary[i % len(vocabulary)] for i in range(words))
    return f"You are the assistant of a small public library. Answer from these facts only: {text}."


def question(i: int) -> str:
    base = QUESTIONS[i % len(QUESTIONS)]
    return base if i < len(QUESTIONS) else f"{base} (question {i + 1})"


@dataclass
class Result:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass
class Report:
    url: str
    model: str
    clients: int
    requests: int
    max_tokens: int
    system_words: int
    wall_s: float
    ok: int
    errors: int
    output_tokens: int
    output_tok_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    latency_p50_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    prefix_hit_ratio: float | None
    error_samples: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"bench.serve: error: {url} is not a loopback address: only local servers are measured")


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    t0 = time.perf_counter()
    first = last = None
    pieces = 0
    usage = None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return Result(False, f"HTTP {response.status_code}: {text[:200]}",
                              latency_s=time.perf_counter() - t0)
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    message = str(chunk["error"].get("message"))
                    return Result(False, message, latency_s=time.perf_counter() - t0)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        pieces += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Result(False, f"{type(exc).__name__}: {exc}", latency_s=time.perf_counter() - t0)
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage and "completion_tokens" in usage else pieces
    details = (usage or {}).get("prompt_tokens_details") or {}
    result = Result(True, latency_s=end - t0, output_tokens=tokens,
                    prompt_tokens=(usage or {}).get("prompt_tokens"),
                    cached_tokens=details.get("cached_tokens"))
    if first is not None:
        result.ttft_s = first - t0
        if tokens > 1:
            result.tpot_s = (last - first) / (tokens - 1)
    return result


async def model_name(client: httpx.AsyncClient, url: str, model: str | None) -> str:
    """`model`, or the first the server lists."""
    if model is not None:
        return model
    return (await client.get(f"{url}/v1/models")).raise_for_status().json()["data"][0]["id"]


async def run(args: argparse.Namespace) -> Report:
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 2, max_keepalive_connections=args.clients + 2)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits) as client:
        model = await model_name(client, url, args.model)
        system = system_prompt(args.system_words)

        def body(i: int) -> dict:
            b = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                 "stream": True, "stream_options": {"include_usage": True},
                 "messages": [{"role": "system", "content": system},
                              {"role": "user", "content": question(i)}]}
            if args.ignore_eos:
                b["ignore_eos"] = True  # an extension (vLLM's, ours): every request generates max_tokens
            return b

        for i in range(args.warmup):
            await one_request(client, url, body(10_000 + i))
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(args.requests):
            queue.put_nowait(i)
        results: list[Result] = []

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await one_request(client, url, body(i)))

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(args.clients)]
        _, pending = await asyncio.wait(tasks, timeout=args.timeout)
        for task in pending:
            task.cancel()
        wall = time.perf_counter() - t0
    missing = args.requests - len(results)
    results += [Result(False, f"not finished within --timeout {args.timeout} s")] * missing
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    with_usage = [r for r in good if r.prompt_tokens and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in with_usage) if with_usage else None
    cached = sum(r.cached_tokens for r in with_usage) if with_usage else None
    ttft = [r.ttft_s for r in good if r.ttft_s is not None]
    tpot = [r.tpot_s for r in good if r.tpot_s is not None]
    return Report(
        url=url, model=model, clients=args.clients, requests=args.requests, max_tokens=args.max_tokens,
        system_words=args.system_words, wall_s=wall, ok=len(good), errors=len(results) - len(good),
        output_tokens=out_tokens, output_tok_s=out_tokens / wall if wall else 0.0,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
        latency_p50_s=percentile([r.latency_s for r in good], 50),
        prompt_tokens=prompt, cached_tokens=cached, prefix_hit_ratio=cached / prompt if prompt else None,
        error_samples=sorted({r.error for r in results if r.error})[:5])


async def prefix_reuse(args: argparse.Namespace) -> dict:
    """Two requests in turn behind one system prompt: TTFT and cached tokens of each."""
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), headers=headers) as client:
        model = await model_name(client, url, args.model)
        system = system_prompt(args.system_words)
        got = []
        for i in range(2):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question(i)}]
            body = {"model": model, "max_tokens": 8, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "messages": messages}
            got.append(await one_request(client, url, body))
    bad = [r.error for r in got if not r.ok or r.ttft_s is None]
    if bad:
        raise SystemExit(f"bench.serve: error: {bad[0] or 'no token came back'}")
    first, second = got
    return {"url": url, "model": model, "system_words": args.system_words,
            "prompt_tokens": first.prompt_tokens,
            "first_ttft_s": first.ttft_s, "first_cached_tokens": first.cached_tokens,
            "second_ttft_s": second.ttft_s, "second_cached_tokens": second.cached_tokens,
            "ttft_ratio": first.ttft_s / second.ttft_s}


def reuse_table(r: dict) -> str:
    def cached(n: int | None) -> str:
        of = f"of {r['prompt_tokens']:,} prompt tokens cached"
        return "n/a (no usage details)" if n is None else f"{n:,} {of}"

    return "\n".join([
        f"{'server':<13}{r['url']}  model {r['model']}",
        f"{'first':<13}TTFT {r['first_ttft_s'] * 1000:.0f} ms, {cached(r['first_cached_tokens'])}",
        f"{'second':<13}TTFT {r['second_ttft_s'] * 1000:.0f} ms, {cached(r['second_cached_tokens'])}",
        f"{'ratio':<13}{r['ttft_ratio']:.1f}x lower TTFT for the second"])


def table(r: Report) -> str:
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v * 1000:.0f} ms"

    hit = "n/a (no usage details)" if r.prefix_hit_ratio is None else (
        f"{100 * r.prefix_hit_ratio:.1f}% ({r.cached_tokens:,} of {r.prompt_tokens:,} prompt tokens)")
    rows = [
        ("server", f"{r.url}  model {r.model}"),
        ("load", f"{r.clients} clients, {r.requests} requests, {r.max_tokens} max tokens, "
                 f"~{r.system_words}-word shared system prompt"),
        ("finished", f"{r.ok} ok, {r.errors} errors in {r.wall_s:.1f} s"),
        ("output", f"{r.output_tokens:,} tokens, {r.output_tok_s:.1f} tok/s aggregate"),
        ("TTFT", f"p50 {ms(r.ttft_p50_s)}, p99 {ms(r.ttft_p99_s)}"),
        ("TPOT", f"p50 {ms(r.tpot_p50_s)}, p99 {ms(r.tpot_p99_s)}"),
        ("latency", f"p50 {ms(r.latency_p50_s)}"),
        ("prefix cache", hit),
    ]
    lines = [f"{name:<13}{value}" for name, value in rows]
    lines += [f"{'error':<13}{e}" for e in r.error_samples]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inferno.bench.serve",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the server (loopback only)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=16, help="requests in all")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--system-words", type=int, default=150, help="words of the shared system prompt")
    parser.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let requests stop at end-of-turn (default: each generates --max-tokens)")
    parser.add_argument("--warmup", type=int, default=0, help="requests sent one by one before the run")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--prefix-reuse", action="store_true",
                        help="two requests in turn behind the system prompt: TTFT and cached tokens of each")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    for name in ("clients", "requests", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    check_loopback(args.url)
    if args.prefix_reuse:
        try:
            reuse = asyncio.run(prefix_reuse(args))
        except httpx.HTTPError as exc:
            print(f"bench.serve: error: {args.url}: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(reuse) if args.json else reuse_table(reuse))
        return 0
    try:
        report = asyncio.run(run(args))
    except httpx.HTTPError as exc:
        print(f"bench.serve: error: {args.url}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(json.dumps(asdict(report)) if args.json else table(report))
    return 0 if report.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
