"""What a GGUF's metadata says about a model's attention: layers, query and KV heads, head size, sliding
windows, context length. One reading of those keys, for any architecture: `ModelConfig` builds on it
and refuses what inferno cannot run; kv-memcalc sizes whatever it describes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gguf import GGUFReader

from inferno.errors import InfernoError
from inferno.file.reader import metadata

# Which layers slide, by architecture, as llama.cpp's set_swa_pattern(n) decides when the file
# does not say: in every group of n layers the last one is global, the others sliding.
ARCH_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}

MAX_LAYERS = 100_000  # far more than any model has; layers are counted one by one


@dataclass(frozen=True)
class ModelInfo:
    arch: str
    layers: int
    kv_heads: tuple[int, ...]  # per layer; 0: the layer keeps no cache
    heads: tuple[int, ...] | None
    head_dim: int | None  # of a K row; None: the file gives no key_length, nor a hidden size to split
    context_length: int | None
    window: int | None
    sliding: frozenset[int] | None  # None: the file has no window, or does not say which layers use it
    mla: bool = False  # head_dim is then the width of the latent row (kv_lora_rank + RoPE dims)
    value_dim: int | None = None  # of a V row, where it differs from head_dim


def read_model_info(reader: GGUFReader) -> ModelInfo:
    """`model_info` of an open GGUF file."""
    return model_info(lambda key: metadata(reader, key))


def model_info(get: Callable[[str], Any]) -> ModelInfo:
    """Read the KV-relevant hyperparameters; `get(key)` returns a metadata value or None."""
    arch = get("general.architecture")
    if not isinstance(arch, str):
        raise InfernoError("GGUF metadata has no general.architecture")

    def key(name: str, per_layer: bool = False) -> Any:
        """An integer, or None when absent; `per_layer` keys may also list one value per layer."""
        value = get(f"{arch}.{name}")
        if isinstance(value, (str, float, bool)) or (isinstance(value, list) and not per_layer):
            raise InfernoError(f"GGUF metadata {arch}.{name} should be an integer, not {value!r}"[:160])
        return value

    layers = key("block_count")
    if not isinstance(layers, int):
        raise InfernoError(f"GGUF metadata has no usable {arch}.block_count (1 to {MAX_LAYERS:,})")
    if not 1 <= layers <= MAX_LAYERS:
        raise InfernoError(f"GGUF metadata {arch}.block_count says {layers} layers: a model has 1 to "
                           f"{MAX_LAYERS:,}")
    heads = _layer_values(key("attention.head_count", True), layers, f"{arch}.attention.head_count")
    # llama.cpp's rule: without head_count_kv the model has as many KV heads as query heads.
    kv_key = f"{arch}.attention.head_count_kv"
    kv_heads = _layer_values(key("attention.head_count_kv", True), layers, kv_key) or heads
    if kv_heads is None:
        raise InfernoError(f"GGUF metadata has neither {arch}.attention.head_count_kv nor head_count")

    head_dim = key("attention.key_length")
    if head_dim is None and heads and heads[0]:
        embedding = key("embedding_length")
        if embedding is not None and embedding % heads[0] == 0:
            head_dim = embedding // heads[0]
    value_dim = key("attention.value_length")

    window = key("attention.sliding_window") or None
    sliding = None
    if window:
        pattern = key("attention.sliding_window_pattern", True)
        if isinstance(pattern, list):
            if len(pattern) != layers:
                raise InfernoError(
                    f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers"
                )
            sliding = frozenset(i for i, slides in enumerate(pattern) if slides)
        elif isinstance(pattern, int):
            # llama.cpp reads a period of 0 as "every layer slides".
            sliding = frozenset(range(layers)) if pattern == 0 else pattern_layers(layers, pattern)
        elif arch in ARCH_SWA_PERIOD:
            sliding = pattern_layers(layers, ARCH_SWA_PERIOD[arch])
    return ModelInfo(arch, layers, kv_heads, heads, head_dim, key("context_length"), window, sliding,
                     value_dim=None if value_dim == head_dim else value_dim)


def _layer_values(value: Any, layers: int, key: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return (value,) * layers
    if isinstance(value, list) and len(value) == layers and all(_integer(v) for v in value):
        return tuple(value)
    raise InfernoError(f"GGUF metadata {key} is neither an integer nor one per layer: {value!r}")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not to a GGUF


def pattern_layers(layers: int, period: int) -> frozenset[int]:
    """Sliding layers when, in every group of `period` layers, the last is global (Gemma 3: period 6).

    Period 1 makes every layer global. This matches llama.cpp's set_swa_pattern(period).
    """
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise InfernoError(f"sliding pattern must be a positive integer, got {period!r}")
    return frozenset(i for i in range(layers) if i % period < period - 1)
