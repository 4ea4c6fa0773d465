"""/metrics: Prometheus text exposition with vLLM's metric names under an `inferno:` prefix.

Every counter and histogram is folded from the per-request `Metrics` record the scheduler keeps (the
record a response's `usage` is read from too), once, when the request ends (`ServerMetrics.observe`).
The gauges (requests running and waiting, KV cache usage) are the engine thread's snapshot of its
scheduler after its last step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from inferno.runtime.scheduler import Generation

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_LABELS = ("stop", "length", "abort", "error")


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        self.count += 1
        self.sum += value


@dataclass(frozen=True)
class EngineState:
    """The scheduler as the engine thread last saw it (after a step, or a submission)."""

    running: int = 0
    waiting: int = 0
    used_blocks: int = 0
    n_blocks: int = 0  # 0: no block pool (--kv other than paged)
    steps: int = 0

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.n_blocks if self.n_blocks else 0.0


class ServerMetrics:
    """Counters and histograms over finished requests; safe to read from the HTTP side while the engine
    thread observes."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.finished = dict.fromkeys(FINISH_LABELS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.state = EngineState()

    def observe(self, gen: Generation) -> None:
        """Fold one finished request's Metrics record in."""
        m = gen.metrics
        with self._lock:
            self.prompt_tokens += m.prompt_tokens
            self.generation_tokens += m.generated_tokens
            self.prefix_queries += m.prompt_tokens
            self.prefix_hits += m.reused_tokens
            self.preemptions += gen.preemptions
            reason = gen.finish_reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if m.generated_tokens:
                self.ttft.observe(m.ttft_ms / 1000)
                self.e2e.observe((m.ttft_ms + m.decode_ms) / 1000)
            if m.tpot_ms is not None:
                self.tpot.observe(m.tpot_ms / 1000)

    def render(self) -> str:
        """The Prometheus text format (version 0.0.4)."""
        label = f'model_name="{_escape(self.model_name)}"'
        out: list[str] = []

        def metric(name: str, metric_type: str, help: str, value: float, extra: str = "") -> None:
            out.append(f"# HELP inferno:{name} {help}")
            out.append(f"# TYPE inferno:{name} {metric_type}")
            out.append(f"inferno:{name}{{{label}{extra}}} {_number(value)}")

        def histogram(name: str, help: str, h: Histogram) -> None:
            out.append(f"# HELP inferno:{name} {help}")
            out.append(f"# TYPE inferno:{name} histogram")
            total = 0
            for bound, count in zip(h.buckets, h.counts, strict=True):
                total += count
                out.append(f'inferno:{name}_bucket{{{label},le="{_number(bound)}"}} {total}')
            out.append(f'inferno:{name}_bucket{{{label},le="+Inf"}} {h.count}')
            out.append(f"inferno:{name}_sum{{{label}}} {_number(h.sum)}")
            out.append(f"inferno:{name}_count{{{label}}} {h.count}")

        with self._lock:
            s = self.state
            metric("num_requests_running", "gauge", "Requests in the running batch.", s.running)
            metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", s.waiting)
            metric("kv_cache_usage_perc", "gauge",
                   "Fraction of the KV block pool held by sequences (1 = full; 0 without a pool).",
                   s.kv_usage)
            metric("prefix_cache_queries_total", "counter",
                   "Prompt tokens looked up in the prefix cache.", self.prefix_queries)
            metric("prefix_cache_hits_total", "counter",
                   "Prompt tokens found in the prefix cache (not computed again).", self.prefix_hits)
            metric("num_preemptions_total", "counter",
                   "Times a request gave its blocks back to be computed again.", self.preemptions)
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   self.prompt_tokens)
            metric("generation_tokens_total", "counter", "Tokens generated by finished requests.",
                   self.generation_tokens)
            out.append("# HELP inferno:request_success_total Finished requests by finish reason.")
            out.append("# TYPE inferno:request_success_total counter")
            for reason, count in self.finished.items():
                out.append(f'inferno:request_success_total{{{label},finished_reason="{reason}"}} {count}')
            histogram("time_to_first_token_seconds", "Time to first token (arrival to first token).",
                      self.ttft)
            histogram("time_per_output_token_seconds", "Mean time per output token after the first, "
                      "per request.", self.tpot)
            histogram("e2e_request_latency_seconds", "Arrival to last token.", self.e2e)
        return "\n".join(out) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
