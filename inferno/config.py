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

        def need(key: str):
            value = metadata(reader, f"{arch}.{key}")
            if value is None:
                raise InfernoError(f"GGUF metadata is missing {arch}.{key}")
            if isinstance(value, list):
                raise InfernoError(f"per-layer {arch}.{key} is not supported")
            return value

        hidden = int(need("embedding_length"))
        n_heads = int(need("attention.head_count"))
        n_kv_heads = int(metadata(reader, f"{arch}.attention.head_count_kv", n_heads))
        head_dim = int(metadata(reader, f"{arch}.attention.key_length", hidden // n_heads))
        if n_heads % n_kv_heads:
            raise InfernoError(f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads")
        scaling = metadata(reader, f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise InfernoError(f"RoPE scaling {scaling!r} is not supported")
        tensor_names = {t.name for t in reader.tensors}
        vocab = metadata(reader, f"{arch}.vocab_size")
        if vocab is None:
            vocab = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
        return cls(
            architecture=arch,
            n_layers=int(need("block_count")),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            ffn_size=int(need("feed_forward_length")),
            vocab_size=int(vocab),
            rope_base=float(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
            rope_dim=int(metadata(reader, f"{arch}.rope.dimension_count", head_dim)),
            rms_eps=float(need("attention.layer_norm_rms_epsilon")),
            context_length=int(need("context_length")),
            tied_embeddings="output.weight" not in tensor_names,
            bos_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
            eos_id=metadata(reader, "tokenizer.ggml.eos_token_id"),
            **ARCHITECTURES[arch],
        )
