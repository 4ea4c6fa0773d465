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
from collections.abc import Iterable, Sequence

from inferno.errors import InfernoError
from inferno.file.hparams import ModelInfo, pattern_layers
from inferno.kv.dtypes import ELEMENT_TYPES, ElementType
from inferno.kv.geometry import KVGeometry

# --dtype: the element types the engines a deployment is planned for store (inferno's rotated and
# grouped variants of q8_0 and q4_0 are its own: `--kv-dtype` sizes those exactly).
DTYPES: dict[str, ElementType] = {
    name: ELEMENT_TYPES[name] for name in ("f32", "f16", "bf16", "fp8", "q8_0", "q4_0")
}


def row_bytes(values: int, dtype: ElementType) -> int:
    """Bytes for one token's keys (or values) in one layer, `values` = kv_heads x head_dim."""
    if values % dtype.block_values:
        raise InfernoError(
            f"{dtype.name} stores blocks of {dtype.block_values} values, but a row of KV heads x head dim "
            f"has {values}; pick another --dtype"
        )
    return dtype.blocks_bytes(values)


def kv_shape(
    layers: int,
    kv_heads: int | Sequence[int],
    head_dim: int,
    heads: int | Sequence[int] | None = None,
    window: int | None = None,
    sliding: Iterable[int] = (),
    mla: bool = False,
) -> KVGeometry:
    """A validated geometry; scalar head counts apply to every layer, and heads=None (not known) is 0.

    `sliding` layers hold at most `window` tokens; the others the whole context.
    """
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
    windows: tuple[int | None, ...] = ()
    if sliding:
        if window is None:
            raise InfernoError("sliding-window layers need a window size (--sliding-window)")
        _require_positive("sliding window", window)
        if max(sliding) >= layers:
            raise InfernoError(f"sliding layer {max(sliding)} does not exist: the model has {layers} layers")
        windows = tuple(window if i in sliding else None for i in range(layers))
    q = q or (0,) * layers
    return KVGeometry(layers, max(kv), max(q), head_dim, windows, kv, q, mla)


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


def kv_heads_by_layer(shape: KVGeometry) -> tuple[int, ...]:
    return shape.layer_kv_heads or (shape.kv_heads,) * shape.layers


def heads_by_layer(shape: KVGeometry) -> tuple[int, ...]:
    """Query heads per layer; all 0 when not known."""
    return shape.layer_heads or (shape.heads,) * shape.layers


def sliding_indices(shape: KVGeometry) -> list[int]:
    """The layers that hold at most their window."""
    return [i for i, window in enumerate(shape.windows) if window is not None]


def longest_window(shape: KVGeometry) -> int:
    """The most tokens a sliding layer holds (`kv_shape` gives them all one window); 0 when none slides."""
    return max((w for w in shape.windows if w is not None), default=0)


def layer_token_bytes(shape: KVGeometry, dtype: ElementType, mha: bool = False) -> list[int]:
    """Bytes one token adds to each layer (its K row plus its V row, or its MLA latent).

    `mha` counts a K and V head per query head instead, in the layers that keep a cache at all.
    """
    heads = kv_heads_by_layer(shape)
    if mha and shape.heads:
        heads = tuple(q if kv else 0 for q, kv in zip(heads_by_layer(shape), heads, strict=True))
    return [shape.rows * row_bytes(h * shape.head_dim, dtype) for h in heads]


def bytes_per_token(shape: KVGeometry, dtype: ElementType, mha: bool = False) -> int:
    """Bytes one token adds across all layers while every layer still holds it."""
    return sum(layer_token_bytes(shape, dtype, mha))


def bytes_per_token_beyond_window(shape: KVGeometry, dtype: ElementType) -> int:
    """Bytes one more token adds once the sliding layers are full: only the full-attention layers grow."""
    per_layer = layer_token_bytes(shape, dtype)
    return sum(b for i, b in enumerate(per_layer) if shape.window(i) is None)


def tokens_held(shape: KVGeometry, layer: int, context: int) -> int:
    window = shape.window(layer)
    return context if window is None else min(context, window)


def cache_bytes(
    shape: KVGeometry, dtype: ElementType, context: int, batch: int = 1, mha: bool = False
) -> int:
    """The whole KV cache for `batch` sequences of `context` tokens."""
    per_layer = layer_token_bytes(shape, dtype, mha)
    return batch * sum(b * tokens_held(shape, i, context) for i, b in enumerate(per_layer))


def max_batch(shape: KVGeometry, dtype: ElementType, budget: int, context: int) -> int:
    """Most sequences of `context` tokens whose cache fits in `budget` bytes (0 if not even one)."""
    return budget // cache_bytes(shape, dtype, context)


def max_context(shape: KVGeometry, dtype: ElementType, budget: int, batch: int) -> int | None:
    """Longest context whose cache for `batch` sequences fits in `budget` bytes.

    None means no limit: every layer with a cache slides, and the full windows already fit.
    """
    if (
        bytes_per_token_beyond_window(shape, dtype) == 0
        and cache_bytes(shape, dtype, longest_window(shape), batch) <= budget
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

MAX_DIGITS = 30  # a count or size written with more digits is larger than anything a machine holds
_COUNT = re.compile(r"(-?\d+)([km]?)", re.IGNORECASE)
_COUNT_SCALE = {"": 1, "k": 1024, "m": 1024 * 1024}


def parse_count(text: str, what: str = "context") -> int:
    """A token count: `4096`, `128k` (= 131,072) or `1m` (= 1,048,576); `_` may group digits."""
    match = _COUNT.fullmatch(text.strip().replace("_", ""))
    if not match:
        raise InfernoError(f"{what} {text!r} is not a whole number of tokens (e.g. 4096, 128k, 1m)")
    check_digits(match.group(1), what)
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
    check_digits(whole + frac, "size")
    scale = _SIZE_UNITS[unit]
    if frac and scale == 1:
        raise InfernoError(f"size {text!r} is not a whole number of bytes")
    # Integer arithmetic so that 1.1GB is exactly 1,100,000,000 bytes, not a float's neighbour.
    size = (int(whole + frac) * scale) // 10 ** len(frac)
    if size < 1:
        raise InfernoError(f"size must be at least 1 byte, got {text!r}")
    return size


def check_digits(digits: str, what: str) -> None:
    """Refuse a number of more than MAX_DIGITS digits (Python will not even read one of 4,300)."""
    if len(digits.lstrip("-")) > MAX_DIGITS:
        raise InfernoError(f"{what} {digits[:12]}... has {len(digits):,} digits: more than anything holds")


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
) -> KVGeometry:
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
        if model.head_dim is None or model.value_dim is not None:
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
