"""The KV cache family: the protocol (`base`), one module per kind, and this factory, the only place
that knows the kinds. `--kv` choices, kv-bench's modes and kv-memcalc all read `KINDS` from here."""

from __future__ import annotations

from inferno.errors import InfernoError
from inferno.kv.base import KVCache, KVCacheFullError
from inferno.kv.basic import BasicKVCache
from inferno.kv.geometry import KVGeometry
from inferno.kv.paged import PagedKVCache
from inferno.kv.prealloc import PreallocKVCache
from inferno.kv.window import WindowKVCache

KINDS: dict[str, type[KVCache]] = {
    cls.kind: cls for cls in (BasicKVCache, PreallocKVCache, WindowKVCache, PagedKVCache)
}
DEFAULT_KIND = "prealloc"

__all__ = ["DEFAULT_KIND", "KINDS", "KVCache", "KVCacheFullError", "KVGeometry", "cache_class", "make_cache"]


def cache_class(kind: str) -> type[KVCache]:
    """The class of the cache kind `kind` names; unknown names are refused with the valid ones."""
    if kind not in KINDS:
        raise InfernoError(f"unknown KV cache kind {kind!r} (valid: {', '.join(KINDS)})")
    return KINDS[kind]


def make_cache(kind: str, geometry: KVGeometry, capacity: int, **options) -> KVCache:
    """A cache of kind `kind` for `capacity` tokens of a model with this geometry; options are the
    kind's own (window: `window`, `sinks`, `positions`, `rotary`; paged: `block_size`)."""
    return cache_class(kind)(geometry, capacity, **options)
