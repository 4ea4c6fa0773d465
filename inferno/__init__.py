"""inferno: run GGUF language models on the CPU and make the KV cache visible."""

from time import perf_counter

__version__ = "0.1.0"
IMPORTED_AT = perf_counter()  # when the first inferno module was imported: a command's start-up begins here
