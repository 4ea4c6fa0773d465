"""How many bytes a KV cache takes, and what fits in a memory budget.

Pure arithmetic and parsing, no I/O: `inferno.cli.memcalc` reads files and prints.

Every layer stores, for every token it holds, one row of keys and one row of values, each
kv_heads x head_dim values wide; multi-head latent attention (MLA, DeepSeek) stores one row
instead, the compressed latent plus the RoPE part of the key. Full-attention layers hold the
whole context; sliding-window layers hold at most the window. All sizes are exact integers:
block formats (q8_0, q4_0) count their scales and refuse rows that are not a whole number of
blocks, so nothing is rounded.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from inferno.errors import InfernoError


@dataclass(frozen=True)
class DType:
    name: str
    block_values: int  # values stored together (1 for plain floats)
    block_bytes: int  # bytes per block, scales included


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("f32", 1, 4),
        DType("f16", 1, 2),
        DType("bf16", 1, 2),
        DType("fp8", 1, 1),
        DType("q8_0", 32, 34),  # 32 int8 values + one f16 scale
        DType("q4_0", 32, 18),  # 32 4-bit values + one f16 scale
    )
}

# Which layers slide, by architecture, as llama.cpp's set_swa_pattern(n) decides when the file
# does not say: in every group of n layers the last one is global, the others sliding.
ARCH_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}


def row_bytes(values: int, dtype: DType) -> int:
    """Bytes for one token's keys (or values) in one layer, `values` = kv_heads x head_dim."""
    blocks, rest = divmod(values, dtype.block_values)
    if rest:
        raise InfernoError(
            f"{dtype.name} stores blocks of {dtype.block_values} values, but a row of KV heads x head dim "
            f"has {values}; pick another --dtype"
        )
    return blocks * dtype.block_bytes


@dataclass(frozen=True)
class KVShape:
    """What decides a KV cache's size. Build it with `kv_shape`, which validates."""

    kv_heads: tuple[int, ...]  # per layer; 0 means the layer keeps no KV cache
    head_dim: int
    heads: tuple[int, ...] | None = None  # query heads per layer, for the multi-head comparison
    window: int | None = None
    sliding: frozenset[int] = frozenset()  # layers holding at most `window` tokens
    mla: bool = False  # one latent row of head_dim values per token and layer, no separate V

    @property
    def layers(self) -> int:
        return len(self.kv_heads)

    @property
    def rows(self) -> int:
        """Rows a token adds to a layer: K and V, or MLA's single latent."""
        return 1 if self.mla else 2


def kv_shape(
    layers: int,
    kv_heads: int | Sequence[int],
    head_dim: int,
    heads: int | Sequence[int] | None = None,
    window: int | None = None,
    sliding: Iterable[int] = (),
    mla: bool = False,
) -> KVShape:
    """A validated KVShape; scalar head counts apply to every layer."""
    _require_positive("layers", layers)
    _require_positive("head dim", head_dim)
    kv = _per_layer("KV heads", kv_heads, layers)
    if all(h == 0 for h in kv):
        raise InfernoError("no layer has KV heads, so there is no KV cache to size")
    q = None if heads is None else _per_layer("query heads", heads, layers)
    uniform = len(set(kv)) == 1 and len(set(q or kv)) == 1
    for i, (k, h) in enumerate(zip(kv, q or kv, strict=True)):
        if k and (h < k or h % k):
            where = "" if uniform else f" in layer {i}"
            raise InfernoError(f"query heads ({h}) are not a multiple of KV heads ({k}){where}")
    sliding = frozenset(sliding)
    if sliding:
        if window is None:
            raise InfernoError("sliding-window layers need a window size (--sliding-window)")
        _require_positive("sliding window", window)
        if max(sliding) >= layers:
            raise InfernoError(f"sliding layer {max(sliding)} does not exist: the model has {layers} layers")
    return KVShape(kv, head_dim, q, window if sliding else None, sliding, mla)


def _require_positive(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InfernoError(f"{what} must be a positive integer, got {value!r}")


def _per_layer(what: str, value: int | Sequence[int], layers: int) -> tuple[int, ...]:
    if isinstance(value, int):
        _require_positive(what, value)
        return (value,) * layers
    values = tuple(value)
    if len(values) != layers:
        raise InfernoError(f"{what} are given for {len(values)} layers, but there are {layers}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise InfernoError(f"{what} per layer must be integers of 0 or more, got {list(values)}")
    return values


def layer_token_bytes(shape: KVShape, dtype: DType, mha: bool = False) -> list[int]:
    """Bytes one token adds to each layer (its K row plus its V row, or its MLA latent).

    `mha` counts a K and V head per query head instead, in the layers that keep a cache at all.
    """
    heads = shape.kv_heads
    if mha and shape.heads:
        heads = tuple(q if kv else 0 for q, kv in zip(shape.heads, shape.kv_heads, strict=True))
    return [shape.rows * row_bytes(h * shape.head_dim, dtype) for h in heads]


def bytes_per_token(shape: KVShape, dtype: DType, mha: bool = False) -> int:
    """Bytes one token adds across all layers while every layer still holds it."""
    return sum(layer_token_bytes(shape, dtype, mha))


def bytes_per_token_beyond_window(shape: KVShape, dtype: DType) -> int:
    """Bytes one more token adds once the sliding layers are full: only the full-attention layers grow."""
    per_layer = layer_token_bytes(shape, dtype)
    return sum(b for i, b in enumerate(per_layer) if i not in shape.sliding)


def tokens_held(shape: KVShape, layer: int, context: int) -> int:
    if layer in shape.sliding:
        return min(context, shape.window)
    return context


def cache_bytes(shape: KVShape, dtype: DType, context: int, batch: int = 1, mha: bool = False) -> int:
    """The whole KV cache for `batch` sequences of `context` tokens."""
    per_layer = layer_token_bytes(shape, dtype, mha)
    return batch * sum(b * tokens_held(shape, i, context) for i, b in enumerate(per_layer))


def max_batch(shape: KVShape, dtype: DType, budget: int, context: int) -> int:
    """Most sequences of `context` tokens whose cache fits in `budget` bytes (0 if not even one)."""
    return budget // cache_bytes(shape, dtype, context)


def max_context(shape: KVShape, dtype: DType, budget: int, batch: int) -> int | None:
    """Longest context whose cache for `batch` sequences fits in `budget` bytes.

    None means no limit: every layer with a cache slides, and the full windows already fit.
    """
    if (
        bytes_per_token_beyond_window(shape, dtype) == 0
        and cache_bytes(shape, dtype, shape.window, batch) <= budget
    ):
        return None
    # Up to the answer every token adds at least one byte, so the answer is at most `budget`.
    lo, hi = 0, budget + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cache_bytes(shape, dtype, mid, batch) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


# --- parsing what users type ---------------------------------------------------------------------

_COUNT = re.compile(r"(-?\d+)([km]?)", re.IGNORECASE)
_COUNT_SCALE = {"": 1, "k": 1024, "m": 1024 * 1024}


def parse_count(text: str, what: str = "context") -> int:
    """A token count: `4096`, `128k` (= 131,072) or `1m` (= 1,048,576); `_` may group digits."""
    match = _COUNT.fullmatch(text.strip().replace("_", ""))
    if not match:
        raise InfernoError(f"{what} {text!r} is not a whole number of tokens (e.g. 4096, 128k, 1m)")
    value = int(match.group(1)) * _COUNT_SCALE[match.group(2).lower()]
    if value < 1:
        raise InfernoError(f"{what} must be at least 1 token, got {text!r}")
    return value


_THOUSANDS = re.compile(r"\d{1,3}(,\d{3})+")


def parse_contexts(values: Iterable[str]) -> list[int]:
    """Contexts from repeated flags and comma lists (`2k,4k`), in the order given, without repeats."""
    contexts: list[int] = []
    for value in values:
        # "128,000" reads as a thousands separator; splitting it would silently ask for 128 and 0.
        if _THOUSANDS.fullmatch(value.strip()):
            raise InfernoError(
                f"context {value!r} is ambiguous: write {value.replace(',', '')} for one context, "
                "or 2k,4k-style values to list several"
            )
        for part in value.split(","):
            context = parse_count(part)
            if context not in contexts:
                contexts.append(context)
    return contexts


_SIZE = re.compile(r"(-?\d+(?:\.\d+)?)\s*([a-z]*)", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes from `24GiB`, `32 GB`, `512MiB`, `1.5TB` or plain `1000000` (case-insensitive), rounded down."""
    match = _SIZE.fullmatch(text.strip().replace("_", ""))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        if match and unit in ("k", "m", "g", "t"):
            raise InfernoError(
                f"size {text!r} is ambiguous: use {unit.upper()}B (powers of 1000) "
                f"or {unit.upper()}iB (powers of 1024)"
            )
        raise InfernoError(f"size {text!r} is not understood: use e.g. 24GiB, 32GB, 512MiB or a byte count")
    whole, _, frac = match.group(1).partition(".")
    scale = _SIZE_UNITS[unit]
    if frac and scale == 1:
        raise InfernoError(f"size {text!r} is not a whole number of bytes")
    # Integer arithmetic so that 1.1GB is exactly 1,100,000,000 bytes, not a float's neighbour.
    size = (int(whole + frac) * scale) // 10 ** len(frac)
    if size < 1:
        raise InfernoError(f"size must be at least 1 byte, got {text!r}")
    return size


def parse_layers(spec: str, layers: int) -> frozenset[int]:
    """Layer indices from `0-4,6-10,12` (0-based, ranges inclusive) or `all`."""
    if spec.strip().lower() == "all":
        return frozenset(range(layers))
    chosen: set[int] = set()
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match:
            raise InfernoError(f"layer list {spec!r} is not understood: use e.g. 0-4,6-10 or all")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise InfernoError(f"layer range {part.strip()!r} runs backwards")
        if last >= layers:
            raise InfernoError(
                f"layer {last} does not exist: the model has {layers} layers (0 to {layers - 1})"
            )
        chosen.update(range(first, last + 1))
    return frozenset(chosen)


def pattern_layers(layers: int, period: int) -> frozenset[int]:
    """Sliding layers when, in every group of `period` layers, the last is global (Gemma 3: period 6).

    Period 1 makes every layer global. This matches llama.cpp's set_swa_pattern(period).
    """
    _require_positive("sliding pattern", period)
    return frozenset(i for i in range(layers) if i % period < period - 1)


def default_contexts(limit: int | None = None) -> list[int]:
    """2k, 4k, ... up to 128k, or up to a model's context length plus that length itself."""
    top = 128 * 1024 if limit is None else limit
    contexts = []
    context = 2048
    while context <= top:
        contexts.append(context)
        context *= 2
    if top not in contexts:
        contexts.append(top)
    return contexts


# --- what a GGUF file's metadata says ---------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    arch: str
    layers: int
    kv_heads: tuple[int, ...]
    heads: tuple[int, ...] | None
    head_dim: int | None
    context_length: int | None
    window: int | None
    sliding: frozenset[int] | None  # None: the file has no window, or does not say which layers use it
    mla: bool = False  # head_dim is then the width of the latent row (kv_lora_rank + RoPE dims)


MAX_LAYERS = 100_000  # far more than any model has; layers are counted one by one


def model_info(get: Callable[[str], Any]) -> ModelInfo:
    """Read the KV-relevant hyperparameters; `get(key)` returns a metadata value or None."""
    arch = get("general.architecture")
    if not isinstance(arch, str):
        raise InfernoError("GGUF metadata has no general.architecture")

    def key(name: str) -> Any:
        return get(f"{arch}.{name}")

    layers = key("block_count")
    if not isinstance(layers, int) or not 1 <= layers <= MAX_LAYERS:
        raise InfernoError(f"GGUF metadata has no usable {arch}.block_count (1 to {MAX_LAYERS:,})")
    heads = _layer_values(key("attention.head_count"), layers, f"{arch}.attention.head_count")
    # llama.cpp's rule: without head_count_kv the model has as many KV heads as query heads.
    kv_heads = (
        _layer_values(key("attention.head_count_kv"), layers, f"{arch}.attention.head_count_kv") or heads
    )
    if kv_heads is None:
        raise InfernoError(f"GGUF metadata has neither {arch}.attention.head_count_kv nor head_count")

    head_dim = key("attention.key_length")
    if head_dim is None and heads and heads[0] and isinstance(key("embedding_length"), int):
        embedding, first = key("embedding_length"), heads[0]
        if embedding % first == 0:
            head_dim = embedding // first
    value_dim = key("attention.value_length")
    if value_dim is not None and value_dim != head_dim:
        head_dim = None  # K and V rows differ in width; resolve_shape asks for --head-dim

    window = key("attention.sliding_window") or None
    if window is not None and not isinstance(window, int):
        raise InfernoError(f"GGUF metadata {arch}.attention.sliding_window is not one integer: {window!r}")
    sliding = None
    if window:
        pattern = key("attention.sliding_window_pattern")
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
    return ModelInfo(arch, layers, kv_heads, heads, head_dim, key("context_length"), window, sliding)


def _layer_values(value: Any, layers: int, key: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int):
        return (value,) * layers
    if isinstance(value, list) and len(value) == layers and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise InfernoError(f"GGUF metadata {key} is neither an integer nor one per layer: {value!r}")


def resolve_shape(
    model: ModelInfo | None,
    *,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    heads: int | None = None,
    window: int | None = None,
    sliding_layers: str | None = None,
    sliding_pattern: int | None = None,
) -> KVShape:
    """Flags where given, else what the model file says, else defaults (head_dim 128)."""
    if layers is None:
        if model is None:
            raise InfernoError("give --layers and --kv-heads, or --model FILE.gguf")
        layers = model.layers
    if kv_heads is None and model is None:
        raise InfernoError("give --kv-heads (the number of key/value heads), or --model FILE.gguf")
    kv = kv_heads if kv_heads is not None else _fit_layers(model.kv_heads, layers, "--kv-heads")
    q = heads
    if q is None and model is not None and model.heads is not None:
        q = _fit_layers(model.heads, layers, "--heads")
    if head_dim is None and model is not None:
        if model.head_dim is None:
            raise InfernoError("the model's metadata gives no single head size (key_length); pass --head-dim")
        head_dim = model.head_dim
    if head_dim is None:
        head_dim = 128

    if sliding_layers is not None and sliding_pattern is not None:
        raise InfernoError("give --sliding-layers or --sliding-pattern, not both")
    if window is None and model is not None:
        window = model.window
    if sliding_layers is not None:
        sliding = parse_layers(sliding_layers, layers)
    elif sliding_pattern is not None:
        sliding = pattern_layers(layers, sliding_pattern)
    elif model is not None and model.sliding is not None:
        sliding = frozenset(i for i in model.sliding if i < layers)
    elif window is not None and (model is None or model.window != window):
        raise InfernoError(
            "--sliding-window needs --sliding-layers or --sliding-pattern to say which layers use it"
        )
    else:
        sliding = frozenset()
    return kv_shape(layers, kv, head_dim, q, window, sliding, mla=model is not None and model.mla)


def _fit_layers(values: tuple[int, ...], layers: int, flag: str) -> int | tuple[int, ...]:
    """The model's per-layer values for a possibly overridden layer count."""
    if len(set(values)) == 1:
        return values[0]
    if len(values) == layers:
        return values
    raise InfernoError(f"the model's head counts vary by layer, so a different --layers also needs {flag}")
