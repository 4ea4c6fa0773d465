"""The shape of a model's KV cache: the one description every cache layout, snapshot, kv-memcalc and
kv-inspect size themselves from.

kv-memcalc also sizes models inferno does not run, whose layers differ in their heads or which cache
one latent row (MLA); the caches refuse such a geometry (`kv_width`), the planner reads it per layer."""

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
    # Per layer where layers differ (the scalars above are then the most any layer has): KV heads, 0 for
    # a layer that keeps no cache, and query heads. () when every layer has kv_heads and heads.
    layer_kv_heads: tuple[int, ...] = ()
    layer_heads: tuple[int, ...] = ()
    # Multi-head latent attention (DeepSeek): one row of head_dim values per token and layer, the
    # compressed latent and the RoPE part of the key, with no separate V row.
    mla: bool = False

    def __post_init__(self):
        for name in ("windows", "layer_kv_heads", "layer_heads"):
            values = getattr(self, name)
            if values and len(values) != self.layers:
                raise ValueError(f"{len(values)} {name} for {self.layers} layers")
        # One spelling of a uniform geometry, so that equal geometries compare equal and `kv_width`
        # checks uniformity in constant time.
        if self.layer_kv_heads.count(self.kv_heads) == self.layers:
            object.__setattr__(self, "layer_kv_heads", ())
        if self.layer_heads.count(self.heads) == self.layers:
            object.__setattr__(self, "layer_heads", ())
        bad = [w for w in self.windows if w is not None and w < 1]
        if bad:
            raise InfernoError(f"a sliding window must hold at least 1 position, got {bad[0]}")

    @property
    def kv_width(self) -> int:
        """Values in one token's K (or V) row of one layer: all KV heads side by side."""
        if self.layer_kv_heads or self.layer_heads or self.mla:
            raise InfernoError(f"inferno's caches hold layers of one shape with K and V rows, not {self}")
        return self.kv_heads * self.head_dim

    @property
    def rows(self) -> int:
        """Rows a token adds to a layer: K and V, or MLA's one latent."""
        return 1 if self.mla else 2

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
        if self.mla:
            shape = f"{self.layers} layers x one MLA latent of {self.head_dim} values"
        else:
            kv = self.layer_kv_heads or (self.kv_heads,)
            heads = str(kv[0]) if len(set(kv)) == 1 else f"{min(kv)}-{max(kv)}"
            shape = f"{self.layers} layers x {heads} KV heads x head_dim {self.head_dim}"
        if not self.sliding:
            return shape
        sizes = sorted({w for w in self.windows if w is not None})
        slides = sum(w is not None for w in self.windows)
        return f"{shape}, {slides} sliding (window {', '.join(map(str, sizes))})"
