"""Model hyperparameters, read from a GGUF file's metadata into one dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGUFReader

from inferno.errors import InfernoError
from inferno.gguf_file import architecture, metadata
from inferno.kv.geometry import KVGeometry

# How each supported architecture differs from plain llama.
# rope_neox: llama.cpp's converter permutes llama's q/k weights so RoPE rotates adjacent pairs
# (x[2i], x[2i+1]); qwen2/qwen3 keep HF's layout and rotate the two halves (x[i], x[i + d/2]).
ARCHITECTURES = {
    "llama": dict(rope_neox=False, qkv_bias=False, qk_norm=False),
    "qwen2": dict(rope_neox=True, qkv_bias=True, qk_norm=False),
    "qwen3": dict(rope_neox=True, qkv_bias=False, qk_norm=True),
}


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

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_geometry(self) -> KVGeometry:
        return KVGeometry(self.n_layers, self.n_kv_heads, self.n_heads, self.head_dim)

    @classmethod
    def from_gguf(cls, reader: GGUFReader) -> ModelConfig:
        arch = architecture(reader)
        if arch not in ARCHITECTURES:
            supported = ", ".join(ARCHITECTURES)
            raise InfernoError(f"unsupported architecture {arch!r} (supported: {supported})")

        def value(key: str, kind: type, default=None):
            found = metadata(reader, f"{arch}.{key}", kind=kind)
            return default if found is None else found

        def need(key: str, kind: type = int):
            found = value(key, kind)
            if found is None:
                raise InfernoError(f"GGUF metadata is missing {arch}.{key}")
            return found

        def count(key: str, default: int | None = None, derived: str = "") -> int:
            """A size: a whole number of at least 1, so no later division or shape can be empty.
            Absent, it is `default` (described by `derived`); with no default it is required."""
            n = value(key, int)
            if n is None and default is None:
                raise InfernoError(f"GGUF metadata is missing {arch}.{key}")
            if n is None:
                n, key = default, f"{key} ({derived})"
            if n < 1:
                raise InfernoError(f"GGUF metadata {arch}.{key} is {n}, must be at least 1")
            return n

        hidden = count("embedding_length")
        n_heads = count("attention.head_count")
        if value("attention.key_length", int) is None and hidden % n_heads:
            raise InfernoError(f"{arch}.embedding_length {hidden} does not split into {n_heads} heads "
                               f"(and there is no {arch}.attention.key_length)")
        head_dim = count("attention.key_length", hidden // n_heads, "embedding_length / head_count")
        if value("attention.value_length", int, head_dim) != head_dim:
            raise InfernoError(f"{arch}.attention.value_length differs from the key length {head_dim}")
        scaling = value("rope.scaling.type", str, "none")
        if scaling != "none":
            raise InfernoError(f"RoPE scaling {scaling!r} is not supported")
        tensors = {t.name: t for t in reader.tensors}
        embedding = tensors.get("token_embd.weight")
        vocab_rows = int(embedding.shape[-1]) if embedding is not None else None
        return cls(
            architecture=arch,
            n_layers=count("block_count"),
            n_heads=n_heads,
            n_kv_heads=count("attention.head_count_kv", n_heads, "head_count"),
            head_dim=head_dim,
            hidden_size=hidden,
            ffn_size=count("feed_forward_length"),
            vocab_size=count("vocab_size", vocab_rows, "rows of token_embd.weight"),
            rope_base=value("rope.freq_base", float, 10000.0),
            rope_dim=count("rope.dimension_count", head_dim, "key_length"),
            rms_eps=need("attention.layer_norm_rms_epsilon", float),
            context_length=count("context_length"),
            tied_embeddings="output.weight" not in tensors,
            bos_id=metadata(reader, "tokenizer.ggml.bos_token_id", kind=int),
            eos_id=metadata(reader, "tokenizer.ggml.eos_token_id", kind=int),
            **ARCHITECTURES[arch],
        )
