"""The engine thread: the one thread that touches the model, its kernels' thread pools and the Scheduler.

It loops: take new submissions and aborts from a thread-safe inbox, `scheduler.step()`, and route each
Event to the asyncio.Queue of the submission it belongs to (`loop.call_soon_threadsafe`). When the
scheduler has no work it sleeps on the inbox (no spinning). Requests join and leave between steps:
continuous batching is the scheduler's; this thread only feeds it.

A finished request's Generation is popped here and handed over whole: its Metrics record is what the
response's `usage` reads and what /metrics folds in (`ServerMetrics.observe`), once.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sys
import threading
import traceback
from dataclasses import dataclass, field

import numpy as np

from inferno.analysis.token_log import probabilities
from inferno.errors import InfernoError
from inferno.runtime.scheduler import Event, Generation, Request, Scheduler, SchedulerFullError
from inferno.serve.metrics import EngineState, ServerMetrics
from inferno.text.tokenizer import GGUFTokenizer

# OpenAI's stand-in for the logprob of a token the model gives (numerically) no chance
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class Alternative:
    token_id: int
    text: str
    bytes: list[int]
    logprob: float


@dataclass(frozen=True)
class LogProb:
    """The sampled token's log-probability under the model's distribution, and the likeliest tokens."""

    token: Alternative
    top: list[Alternative]


@dataclass
class Item:
    """What one step did for one choice of a submission."""

    index: int  # the choice
    token: int | None
    text: str
    finish_reason: str | None = None
    logprob: LogProb | None = None
    generation: Generation | None = None  # once finished: the request's record (metrics, output)
    error: str | None = None


@dataclass(eq=False)
class Submission:
    """Requests one HTTP request asked for (n choices, or several prompts), accepted or refused
    together; their items arrive, a list per step, on `queue`."""

    requests: list[Request]
    top_logprobs: int | None  # alternatives per token; None: no logprobs
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    accepted: asyncio.Future | None = None
    ids: list[int] = field(default_factory=list)  # the scheduler's, set by the engine thread
    open: int = 0  # choices not finished yet (engine thread)

    def post(self, what) -> None:
        """From the engine thread: hand `what` (a list of Items) to the HTTP side."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, what)

    def resolve(self, result: list[int] | BaseException) -> None:
        def settle() -> None:
            if self.accepted is None or self.accepted.done():
                return
            if isinstance(result, BaseException):
                self.accepted.set_exception(result)
            else:
                self.accepted.set_result(result)

        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(settle)


class EngineLoop:
    """Owns `scheduler` in a thread of its own; `submit`, `abort` and `stop` are safe from any thread."""

    def __init__(self, scheduler: Scheduler, tokenizer: GGUFTokenizer, metrics: ServerMetrics):
        self.scheduler, self.tokenizer, self.metrics = scheduler, tokenizer, metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[int, tuple[Submission, int]] = {}  # request id -> (its submission, choice)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="inferno-engine", daemon=True)
        self.failed: str | None = None  # why the thread ended, when it ended on an error

    # -- from the HTTP side ------------------------------------------------------------------------

    def start(self) -> None:
        self._publish_state()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def submit(self, requests: list[Request], top_logprobs: int | None = None) -> Submission:
        """Queue `requests` together; returns once the engine thread took them (their ids set), or raises
        SchedulerFullError / InfernoError when it refused them (none of them then runs)."""
        if not self.alive:
            raise SchedulerFullError("the server is shutting down")
        loop = asyncio.get_running_loop()
        sub = Submission(requests, top_logprobs, loop, accepted=loop.create_future())
        self._inbox.put(("submit", sub))
        try:
            await sub.accepted
        except asyncio.CancelledError:
            self.abort(sub)  # the client went away before the engine thread took it
            raise
        return sub

    def abort(self, sub: Submission) -> None:
        """End the submission's requests still going; their blocks are freed at the next step."""
        self._inbox.put(("abort", sub))

    def request_stop(self) -> None:
        """Abort every request (their streams end with finish_reason "abort") and end the thread, without
        waiting for it (a signal handler's call)."""
        self._inbox.put(("stop", None))

    def stop(self, timeout: float = 10.0) -> None:
        """request_stop, and wait for the thread to end."""
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._take(block=not self.scheduler.has_work)
                if self.scheduler.has_work and not self._stopping:
                    self._step()
            for sub, _ in list(self._routes.values()):
                self._abort(sub)
            while self.scheduler.has_work:
                self._step()
        except BaseException as exc:  # a bug: say so, and let every waiting request end with an error
            self.failed = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
            self._fail_all(self.failed)
        finally:
            self._stopping = True
            self._publish_state()
            self._refuse_inbox()

    def _take(self, block: bool) -> None:
        """Everything in the inbox (waiting for the first command when `block`)."""
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            verb, sub = command
            if verb == "submit":
                self._add(sub)
            elif verb == "abort":
                self._abort(sub)
            else:
                self._stopping = True
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._publish_state()

    def _add(self, sub: Submission) -> None:
        scheduler = self.scheduler
        bound = scheduler.max_waiting
        if bound is not None and len(scheduler.waiting) + len(sub.requests) > bound:
            sub.resolve(SchedulerFullError(f"{len(scheduler.waiting)} requests are already waiting "
                                           f"(--max-waiting {bound})"))
            return
        try:
            for index, request in enumerate(sub.requests):
                rid = scheduler.add(request)
                sub.ids.append(rid)
                self._routes[rid] = (sub, index)
                sub.open += 1
        except InfernoError as exc:
            self._abort(sub)  # those added already go; their abort events are dropped
            sub.resolve(exc)
            sub.requests = []
            return
        except Exception as exc:
            self._abort(sub)
            sub.resolve(InfernoError(f"the scheduler refused the request: {exc}"))
            sub.requests = []
            return
        sub.resolve(list(sub.ids))

    def _abort(self, sub: Submission) -> None:
        for rid in sub.ids:
            self.scheduler.abort(rid)

    def _step(self) -> None:
        try:
            events = self.scheduler.step()
        except Exception as exc:  # a bug in a forward: end what runs, keep serving
            traceback.print_exc(file=sys.stderr)
            self._fail_all(f"{type(exc).__name__}: {exc}")
            return
        out: dict[int, tuple[Submission, list[Item]]] = {}
        for event in events:
            route = self._routes.get(event.request_id)
            if route is None:
                continue
            sub, index = route
            item = self._item(sub, index, event)
            out.setdefault(id(sub), (sub, []))[1].append(item)
        for sub, items in out.values():
            if sub.requests:  # not refused at submission (whose partial requests' ends are dropped)
                sub.post(items)
        self._publish_state()

    def _item(self, sub: Submission, index: int, event: Event) -> Item:
        item = Item(index, event.token, event.text, event.finish_reason, error=event.error)
        request = self.scheduler.get(event.request_id).request
        if (sub.top_logprobs is not None and event.token is not None and event.logits is not None
                and (request.ignore_eos or not self.tokenizer.is_stop(event.token))):
            item.logprob = self._logprob(event.token, event.logits, sub.top_logprobs)
        if event.finish_reason is not None:
            item.generation = self.scheduler.pop(event.request_id)
            del self._routes[event.request_id]
            sub.open -= 1
            self.metrics.observe(item.generation)
        return item

    def _logprob(self, token: int, logits: np.ndarray, k: int) -> LogProb:
        with np.errstate(divide="ignore"):
            logprobs = np.log(probabilities(logits))
        top = []
        if k:
            best = np.argpartition(-logprobs, k - 1)[:k] if k < len(logprobs) else np.arange(len(logprobs))
            best = best[np.argsort(-logprobs[best], kind="stable")]
            top = [self._alternative(int(i), logprobs[i]) for i in best]
        return LogProb(self._alternative(token, logprobs[token]), top)

    def _alternative(self, token: int, logprob: float) -> Alternative:
        value = float(logprob) if np.isfinite(logprob) else MIN_LOGPROB
        return Alternative(token, self.tokenizer.token_text(token), list(self.tokenizer.token_bytes(token)),
                           max(value, MIN_LOGPROB))

    def _publish_state(self) -> None:
        s, pool = self.scheduler, self.scheduler.pool
        self.metrics.state = EngineState(len(s.running), len(s.waiting), pool.used_blocks if pool else 0,
                                         pool.n_blocks if pool else 0, s.steps)

    def _fail_all(self, message: str) -> None:
        """End every routed request with an error (after a failure the scheduler cannot be trusted)."""
        subs = {id(sub): sub for sub, _ in self._routes.values()}
        for rid, (sub, index) in list(self._routes.items()):
            with contextlib.suppress(Exception):
                self.scheduler.abort(rid)
            with contextlib.suppress(Exception):
                gen = self.scheduler.pop(rid)
                self.metrics.observe(gen)
            sub.post([Item(index, None, "", "error", error=message)])
        self._routes.clear()
        for sub in subs.values():
            sub.open = 0
        with contextlib.suppress(Exception):
            self.scheduler.waiting.clear()
            self.scheduler.running.clear()
            self.scheduler._ended.clear()

    def _refuse_inbox(self) -> None:
        """Submissions that came in after the thread ended are refused (503)."""
        while True:
            try:
                verb, sub = self._inbox.get_nowait()
            except queue.Empty:
                return
            if verb == "submit":
                sub.resolve(SchedulerFullError("the server is shutting down"))

