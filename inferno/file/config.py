"""Model hyperparameters, read from a GGUF file's metadata into one dataclass."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gguf import GGUFReader

from inferno.errors import InfernoError
from inferno.file.hparams import read_model_info
from inferno.file.reader import architecture, metadata
from inferno.kv.geometry import KVGeometry

# How each supported architecture differs from plain llama.
# rope_neox: llama.cpp's converter permutes llama's q/k weights so RoPE rotates adjacent pairs
# (x[2i], x[2i+1]); qwen2/qwen3 keep HF's layout and rotate the two halves (x[i], x[i + d/2]).
ARCHITECTURES = {
    "llama": dict(rope_neox=False, qkv_bias=False, qk_norm=False),
    "qwen2": dict(rope_neox=True, qkv_bias=True, qk_norm=False),
    "qwen3": dict(rope_neox=True, qkv_bias=False, qk_norm=True),
    # gemma3 also scales embeddings, gates its FFN with GELU (tanh) and norms each block's outputs
    # (see _gemma3); its norm weights are stored as 1 + w, so they apply like anyone else's.
    "gemma3": dict(rope_neox=True, qkv_bias=False, qk_norm=True),
}

# What a gemma3 file does not say and llama.cpp and transformers both assume: the sliding layers (every
# sixth is global: `inferno.file.hparams`) rotate with RoPE base 10000.
GEMMA3_SLIDING_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    ffn_size: int
    vocab_size: int
    rope_base: float
    rope_dim: int
    rope_neox: bool
    rms_eps: float
    context_length: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    bos_id: int | None
    eos_id: int | None
    # Per layer: how many positions (its own included) a query sees, None for all of them. A query at
    # position p then attends to keys p - W + 1 .. p: the cache need not keep older rows for that layer.
    layer_windows: tuple[int | None, ...] = ()  # () is every layer global
    layer_rope_bases: tuple[float, ...] = ()  # () is rope_base on every layer
    embedding_scale: float = 1.0  # token embeddings are multiplied by it (gemma3: sqrt(hidden))
    ffn_activation: str = "silu"  # of the gated FFN: "silu" or "gelu_tanh"

    def __post_init__(self) -> None:
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.n_layers)
        if not self.layer_rope_bases:
            object.__setattr__(self, "layer_rope_bases", (self.rope_base,) * self.n_layers)

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_geometry(self) -> KVGeometry:
        windows = self.layer_windows if any(w is not None for w in self.layer_windows) else ()
        return KVGeometry(self.n_layers, self.n_kv_heads, self.n_heads, self.head_dim, windows)

    @classmethod
    def from_gguf(cls, reader: GGUFReader) -> ModelConfig:
        arch = architecture(reader)
        if arch not in ARCHITECTURES:
            supported = ", ".join(ARCHITECTURES)
            raise InfernoError(f"unsupported architecture {arch!r} (supported: {supported})")

        def value(key: str, expected: type, default=None):
            found = metadata(reader, f"{arch}.{key}", expected=expected)
            return default if found is None else found

        def need(key: str, expected: type = int):
            found = value(key, expected)
            if found is None:
                raise InfernoError(f"GGUF metadata is missing {arch}.{key}")
            return found

        def count(key: str, default: int | None = None, derived: str = "") -> int:
            return size(key, value(key, int), default, derived)

        def size(key: str, n: int | None, default: int | None = None, derived: str = "") -> int:
            """A size: a whole number of at least 1, so no later division or shape can be empty.
            Absent, it is `default` (described by `derived`); with no default it is required."""
            if n is None and default is None:
                raise InfernoError(f"GGUF metadata is missing {arch}.{key}")
            if n is None:
                n, key = default, f"{key} ({derived})"
            if n < 1:
                raise InfernoError(f"GGUF metadata {arch}.{key} is {n}, must be at least 1")
            return n

        def one(key: str, per_layer: tuple[int, ...] | None) -> int | None:
            """The one count every layer has: inferno runs models whose layers all have the same heads."""
            if per_layer is not None and len(set(per_layer)) > 1:
                raise InfernoError(f"GGUF metadata {arch}.{key} differs between layers ({min(per_layer)} to "
                                   f"{max(per_layer)}): inferno runs models whose layers all match")
            return None if per_layer is None else per_layer[0]

        # The attention's keys, read as kv-memcalc reads them; what follows refuses what inferno cannot run.
        info = read_model_info(reader)
        hidden = count("embedding_length")
        n_heads = size("attention.head_count", one("attention.head_count", info.heads))
        n_kv_heads = size("attention.head_count_kv", one("attention.head_count_kv", info.kv_heads))
        if info.head_dim is None:
            raise InfernoError(f"{arch}.embedding_length {hidden} does not split into {n_heads} heads "
                               f"(and there is no {arch}.attention.key_length)")
        head_dim = size("attention.key_length", info.head_dim)
        if info.value_dim is not None:
            raise InfernoError(f"{arch}.attention.value_length differs from the key length {head_dim}")
        scaling = value("rope.scaling.type", str, "none")
        if scaling != "none":
            raise InfernoError(f"RoPE scaling {scaling!r} is not supported")
        tensors = {t.name: t for t in reader.tensors}
        embedding = tensors.get("token_embd.weight")
        vocab_rows = int(embedding.shape[-1]) if embedding is not None else None
        n_layers = info.layers
        if n_layers > len(reader.tensors):  # every layer has tensors; per-layer tuples follow from this count
            raise InfernoError(f"GGUF metadata says {n_layers} layers but the file has only "
                               f"{len(reader.tensors)} tensors")
        rope_base = value("rope.freq_base", float, 10000.0)
        if arch == "gemma3" and not info.window:
            raise InfernoError(f"GGUF metadata {arch}.attention.sliding_window is missing or 0")
        sliding = info.sliding or frozenset()  # gemma3 always has a pattern (ARCH_SWA_PERIOD)
        extra = _gemma3(n_layers, hidden, rope_base, info.window, sliding) if arch == "gemma3" else {}
        return cls(
            architecture=arch,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            ffn_size=count("feed_forward_length"),
            vocab_size=count("vocab_size", vocab_rows, "rows of token_embd.weight"),
            rope_base=rope_base,
            rope_dim=count("rope.dimension_count", head_dim, "key_length"),
            rms_eps=need("attention.layer_norm_rms_epsilon", float),
            context_length=size("context_length", info.context_length),
            tied_embeddings="output.weight" not in tensors,
            bos_id=metadata(reader, "tokenizer.ggml.bos_token_id", expected=int),
            eos_id=metadata(reader, "tokenizer.ggml.eos_token_id", expected=int),
            **ARCHITECTURES[arch],
            **extra,
        )


def _gemma3(n_layers: int, hidden: int, rope_base: float, window: int, sliding: frozenset[int]) -> dict:
    """gemma3's fields beyond plain llama: its sliding layers (5, 11, 17, ... are global) and their RoPE."""
    is_global = [i not in sliding for i in range(n_layers)]
    return dict(
        layer_windows=tuple(None if g else window for g in is_global),
        layer_rope_bases=tuple(rope_base if g else GEMMA3_SLIDING_ROPE_BASE for g in is_global),
        embedding_scale=math.sqrt(hidden),
        ffn_activation="gelu_tanh",
    )
