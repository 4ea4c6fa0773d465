"""The shape of a model's KV cache: the one description every cache kind, snapshot, kv-memcalc and
kv-inspect size themselves from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGeometry:
    layers: int
    kv_heads: int  # heads of K and V; query heads share them in groups (GQA, MQA when 1)
    heads: int  # query heads
    head_dim: int

    @property
    def kv_width(self) -> int:
        """Values in one token's K (or V) row of one layer: all KV heads side by side."""
        return self.kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads reading each KV head."""
        return self.heads // self.kv_heads

    def nbytes(self, tokens: int, itemsize: int) -> int:
        """Bytes of K and V for `tokens` tokens in every layer, at `itemsize` bytes per value."""
        return 2 * self.layers * tokens * self.kv_width * itemsize

    def __str__(self) -> str:
        return f"{self.layers} layers x {self.kv_heads} KV heads x head_dim {self.head_dim}"
