"""The shape of a model's KV cache: the one description every cache kind, snapshot, kv-memcalc and
kv-inspect size themselves from."""

from __future__ import annotations

from dataclasses import dataclass, replace

from inferno.errors import InfernoError


@dataclass(frozen=True)
class KVGeometry:
    layers: int
    kv_heads: int  # heads of K and V; query heads share them in groups (GQA, MQA when 1)
    heads: int  # query heads
    head_dim: int
    # Per layer, the positions a sliding-window layer attends to (None: a global layer); () when no
    # layer slides. Set by a model whose layers slide (Gemma 3) or by `--window` for every layer.
    windows: tuple[int | None, ...] = ()

    def __post_init__(self):
        if self.windows and len(self.windows) != self.layers:
            raise ValueError(f"{len(self.windows)} windows for {self.layers} layers")
        bad = [w for w in self.windows if w is not None and w < 1]
        if bad:
            raise InfernoError(f"a sliding window must hold at least 1 position, got {bad[0]}")

    @property
    def kv_width(self) -> int:
        """Values in one token's K (or V) row of one layer: all KV heads side by side."""
        return self.kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads reading each KV head."""
        return self.heads // self.kv_heads

    @property
    def sliding(self) -> bool:
        """Whether any layer has a sliding window."""
        return any(w is not None for w in self.windows)

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for a global layer."""
        return self.windows[layer] if self.windows else None

    def with_window(self, window: int) -> KVGeometry:
        """This geometry with every layer sliding over `window` positions (`--window`); a model that
        sets its own windows keeps them."""
        if self.sliding:
            raise InfernoError("the model sets its own sliding window per layer: --window cannot replace it")
        return replace(self, windows=(window,) * self.layers)

    def nbytes(self, tokens: int, itemsize: int) -> int:
        """Bytes of K and V for `tokens` tokens in every layer, at `itemsize` bytes per value."""
        return 2 * self.layers * tokens * self.kv_width * itemsize

    def __str__(self) -> str:
        shape = f"{self.layers} layers x {self.kv_heads} KV heads x head_dim {self.head_dim}"
        if not self.sliding:
            return shape
        sizes = sorted({w for w in self.windows if w is not None})
        slides = sum(w is not None for w in self.windows)
        return f"{shape}, {slides} sliding (window {', '.join(map(str, sizes))})"
