"""The runtime: requests scheduled into one forward per step with continuous batching (scheduler),
the threads each step runs on (threads), a loaded model with its tokenizer, warmed kernels and the
Python API (engine), and what a run cost and produced (metrics)."""
