"""`model-serve`: an OpenAI-compatible HTTP server on inferno's scheduler.

    protocol     the request schema (pydantic) and OpenAI's error object
    engine_loop  the one thread that owns the Engine and its Scheduler: submissions in, events out
    metrics      per-request Metrics records folded into Prometheus counters and histograms
    app          the FastAPI app: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics

The HTTP side parses, renders the chat template, tokenizes (in a worker thread: the tokenizer's encode
is thread-safe) and streams; everything that touches the model or the KV cache runs in the engine
thread, between scheduler steps.
"""
