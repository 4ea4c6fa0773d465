"""The KV cache family: the protocol (`base`), one module per layout, and this factory, the only place
that knows the layouts. `--kv` choices, kv-bench's modes and kv-memcalc all read `LAYOUTS` from here;
`--kv-dtype` choices read `DTYPES` (the element types of `inferno.kv.dtypes`)."""

from __future__ import annotations

import inspect

from inferno.errors import InfernoError
from inferno.kv.base import KVCache, KVCacheFullError
from inferno.kv.basic import BasicKVCache
from inferno.kv.dtypes import DTYPES, F32
from inferno.kv.geometry import KVGeometry
from inferno.kv.paged import PagedKVCache
from inferno.kv.prealloc import PreallocKVCache
from inferno.kv.window import WindowKVCache

LAYOUTS: dict[str, type[KVCache]] = {
    cls.layout: cls for cls in (BasicKVCache, PreallocKVCache, WindowKVCache, PagedKVCache)
}
DEFAULT_LAYOUT = "prealloc"

DEFAULT_DTYPE = F32

__all__ = [
    "DEFAULT_DTYPE", "DEFAULT_LAYOUT", "DTYPES", "LAYOUTS", "KVCache", "KVCacheFullError", "KVGeometry",
    "cache_class", "make_cache", "planned_nbytes",
]


def cache_class(layout: str) -> type[KVCache]:
    """The class of the cache layout `layout` names; unknown names are refused with the valid ones."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise InfernoError(f"unknown KV cache layout {layout!r} (valid: {', '.join(LAYOUTS)})")
    return LAYOUTS[layout]


def make_cache(
    layout: str, geometry: KVGeometry, capacity: int, dtype: str = DEFAULT_DTYPE, **options
) -> KVCache:
    """A cache of layout `layout` holding rows of element type `dtype`, for `capacity` tokens of a model with
    this geometry; options are the layout's own (window: `window`, `sinks`, `positions`, `rotary`; paged:
    `block_size`)."""
    cls = cache_class(layout)
    _check_options(cls, cls.__init__, options)
    _check_values(capacity, dtype, options)
    return cls(geometry, capacity, dtype=dtype, **options)


def planned_nbytes(
    layout: str, geometry: KVGeometry, capacity: int, dtype: str = DEFAULT_DTYPE, **options
) -> int:
    """Bytes `make_cache(layout, geometry, capacity, dtype, **options)` allocates for keys and values
    (what kv-memcalc prints)."""
    cls = cache_class(layout)
    _check_options(cls, cls.planned_nbytes, {k: v for k, v in options.items() if k != "rotary"})
    _check_values(capacity, dtype, options)
    return cls.planned_nbytes(geometry, capacity, dtype=dtype, **options)


def _check_options(cls: type[KVCache], method, options: dict) -> None:
    """Options a layout does not take are refused by name (window's `window` given to prealloc, say)."""
    unknown = [name for name in options if name not in inspect.signature(method).parameters]
    if unknown:
        raise InfernoError(f"{', '.join(unknown)} do not apply to a {cls.layout!r} cache")


# The least each count a layout takes may be; None (the layout's default) is always allowed.
_OPTION_MINIMUM = {"block_size": 1, "window": 1, "sinks": 0}


def _check_values(capacity: int, dtype: str, options: dict) -> None:
    """Types and values, each refused by name before a cache divides by a block size of 0 or sizes
    itself from a str."""
    from inferno import arguments

    arguments.count("capacity", capacity)
    arguments.choice("dtype", dtype, DTYPES)
    for name, minimum in _OPTION_MINIMUM.items():
        arguments.optional_count(name, options.get(name), minimum)
