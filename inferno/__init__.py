"""inferno: run GGUF language models on the CPU and make the KV cache visible."""

__version__ = "0.1.0"
