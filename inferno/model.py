"""The transformer: llama, qwen2, qwen3 and gemma3 in one readable forward, with two paths.

- `prefill(tokens, cache)` runs a whole prompt at once and stores every layer's K (after RoPE) and V.
- `decode(token, pos, cache)` runs one token at position `pos`: it appends that token's K/V and
  attends one query over the cache.
- `forward(tokens)` is the naive path with no cache: the whole sequence, every step.

Weights stay in their GGUF type (`QuantizedMatrix`); activations are float32 throughout (the 4-bit
types' products split them into int8 parts exact to float32, unless `set_activations("int8")`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import gguf
import numpy as np
from gguf import GGUFReader

from inferno import kernels
from inferno.config import ModelConfig
from inferno.errors import InfernoError
from inferno.kv import KVCache
from inferno.kv.batch import batch_of
from inferno.quant import QuantizedMatrix, tensor_to_float32, uses_blas
from inferno.quant_batch import batch_matmul
from inferno.validate import check_finite_weights, check_model_file

MatMul = Callable[[QuantizedMatrix, np.ndarray], np.ndarray]  # x [n, cols] -> [n, rows]

PREFILL_CHUNK = 512  # tokens per forward when prefilling into a cache that evicts


class Projections:
    """Weights applied to the same input (q/k/v; gate/up). Those sharing a block type and row length
    are stacked into one QuantizedMatrix, so a decode step makes one kernel call for all of them."""

    def __init__(self, matrices: list[QuantizedMatrix], names: list[str]):
        """matrices: stacked weights holding, between them, the weights `names` (returned in that order)."""
        self.matrices = matrices
        place = {name: (m, p) for m, mat in enumerate(matrices) for p, name in enumerate(mat.part_names)}
        self._where = [place[name] for name in names]  # (matrix, part) holding each weight

    @classmethod
    def from_tensors(cls, tensors: list[gguf.ReaderTensor]) -> Projections:
        return cls(stack_tensors(tensors), [t.name for t in tensors])

    def __call__(self, x: np.ndarray, matmul: MatMul | None = None) -> list[np.ndarray]:
        """x [T, in] through every weight: one [T, out_i] array per weight, in the order given.
        matmul: the product of a stacked matrix and x (batched decoding's), instead of the default."""
        if matmul is None and uses_blas(x.shape[0]):
            return [self.matrices[m].matmul(x, part=p) for m, p in self._where]
        # Few rows (decode has one): one matvec per stacked matrix and row, then each weight's columns.
        outs = [(matmul or QuantizedMatrix.matmul)(m, x) for m in self.matrices]
        views = []
        for m, p in self._where:
            first, n = self.matrices[m].parts[p]
            views.append(np.ascontiguousarray(outs[m][:, first : first + n]))  # no copy for one row
        return views


def stack_tensors(tensors: list[gguf.ReaderTensor]) -> list[QuantizedMatrix]:
    """The tensors as stacked matrices, one per block type and row length, in order of first appearance."""
    kinds: dict[tuple[int, int], list[gguf.ReaderTensor]] = {}
    for t in tensors:
        kinds.setdefault((int(t.tensor_type), int(t.shape[0])), []).append(t)
    return [QuantizedMatrix.from_tensors(members) for members in kinds.values()]


class Weights(Protocol):
    """Where a model's weights come from: the GGUF itself (`GGUFWeights`) or the prepared-model cache."""

    def has(self, name: str) -> bool: ...

    def vector(self, name: str) -> np.ndarray: ...

    def stacked(self, names: list[str]) -> list[QuantizedMatrix]: ...


class GGUFWeights:
    """Weights read from the file: norms and biases as float32, matrices repacked into tiles. Keeps
    what it built (`built`, by tensor name or stacked name) for the prepared-model cache."""

    def __init__(self, reader: GGUFReader, config: ModelConfig):
        self._tensors = {t.name: t for t in reader.tensors}
        self._architecture = config.architecture
        self.built: dict[str, np.ndarray | QuantizedMatrix] = {}

    def has(self, name: str) -> bool:
        return name in self._tensors

    def _tensor(self, name: str) -> gguf.ReaderTensor:
        if name not in self._tensors:
            raise InfernoError(f"GGUF file has no tensor {name} ({self._architecture} needs it)")
        return self._tensors[name]

    def vector(self, name: str) -> np.ndarray:
        self.built[name] = tensor_to_float32(self._tensor(name))
        return self.built[name]

    def stacked(self, names: list[str]) -> list[QuantizedMatrix]:
        matrices = stack_tensors([self._tensor(name) for name in names])
        self.built |= {m.name: m for m in matrices}
        return matrices


@dataclass
class Layer:
    attn_norm: np.ndarray
    qkv: Projections
    wo: QuantizedMatrix
    bq: np.ndarray | None  # qwen2
    bk: np.ndarray | None
    bv: np.ndarray | None
    q_norm: np.ndarray | None  # qwen3: RMSNorm over each head of q and k before RoPE
    k_norm: np.ndarray | None
    ffn_norm: np.ndarray
    gate_up: Projections
    w_down: QuantizedMatrix
    post_attn_norm: np.ndarray | None = None  # gemma3: RMSNorm of the attention and FFN outputs
    post_ffn_norm: np.ndarray | None = None  # before they join the residual stream


def rope_frequencies(config: ModelConfig, base: float | None = None) -> np.ndarray:
    """Rotation frequency of each dimension pair, in float32 as the HF reference computes them.

    base: the RoPE base of a layer that has its own (default: the model's rope_base)."""
    base = config.rope_base if base is None else base
    exponents = np.arange(0, config.rope_dim, 2, dtype=np.float32) / np.float32(config.rope_dim)
    return (np.float32(1.0) / np.power(np.float32(base), exponents)).astype(np.float32)


class Transformer:
    def __init__(
        self,
        config: ModelConfig,
        embedding: QuantizedMatrix,
        layers: list[Layer],
        output_norm: np.ndarray,
        output: QuantizedMatrix,
    ):
        self.config = config
        self.embedding = embedding
        self.layers = layers
        self.output_norm = output_norm
        self.output = output
        self.activations = "f32"  # how the matrix-vector products take activations (set_activations)
        bases = {base: rope_frequencies(config, base) for base in set(config.layer_rope_bases)}
        self.layer_inv_freq = [bases[base] for base in config.layer_rope_bases]
        self.layer_rotary = [kernels.Rotary(f, config.rope_neox) for f in self.layer_inv_freq]

    @classmethod
    def from_gguf(cls, reader: GGUFReader) -> Transformer:
        return cls.from_weights(*cls.weights_of(reader))

    @staticmethod
    def weights_of(reader: GGUFReader) -> tuple[ModelConfig, GGUFWeights]:
        """The file's config and its weights, once the file is checked to hold what the config needs."""
        config = ModelConfig.from_gguf(reader)
        check_model_file(reader, config)
        return config, GGUFWeights(reader, config)

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: Weights) -> Transformer:

        def matrix(name: str) -> QuantizedMatrix:
            return weights.stacked([name])[0]

        def projections(names: list[str]) -> Projections:
            return Projections(weights.stacked(names), names)

        def optional(name: str) -> np.ndarray | None:
            return weights.vector(name) if weights.has(name) else None

        layers = [
            Layer(
                attn_norm=weights.vector(f"blk.{i}.attn_norm.weight"),
                qkv=projections([f"blk.{i}.attn_{w}.weight" for w in "qkv"]),
                wo=matrix(f"blk.{i}.attn_output.weight"),
                bq=optional(f"blk.{i}.attn_q.bias"),
                bk=optional(f"blk.{i}.attn_k.bias"),
                bv=optional(f"blk.{i}.attn_v.bias"),
                q_norm=optional(f"blk.{i}.attn_q_norm.weight"),
                k_norm=optional(f"blk.{i}.attn_k_norm.weight"),
                ffn_norm=weights.vector(f"blk.{i}.ffn_norm.weight"),
                gate_up=projections([f"blk.{i}.ffn_{w}.weight" for w in ("gate", "up")]),
                w_down=matrix(f"blk.{i}.ffn_down.weight"),
                post_attn_norm=optional(f"blk.{i}.post_attention_norm.weight"),
                post_ffn_norm=optional(f"blk.{i}.post_ffw_norm.weight"),
            )
            for i in range(config.n_layers)
        ]
        embedding = matrix("token_embd.weight")
        output = embedding if config.tied_embeddings else matrix("output.weight")
        model = cls(config, embedding, layers, weights.vector("output_norm.weight"), output)
        check_finite_weights(model)
        return model

    def layer_matrices(self) -> Iterator[QuantizedMatrix]:
        """The layers' weight matrices: those a long prompt's prefill multiplies through BLAS."""
        for layer in self.layers:
            yield from layer.qkv.matrices
            yield layer.wo
            yield from layer.gate_up.matrices
            yield layer.w_down

    def set_activations(self, name: str) -> None:
        """How every matrix-vector product takes its activations (nibble_dots.ACTIVATIONS): "f32",
        the default, keeps the float reference's tokens; "int8" rounds them as llama.cpp does."""
        for matrix in (*self.layer_matrices(), self.output):
            matrix.activations = name
        self.activations = name

    # -- the two cached paths ------------------------------------------------------------------

    def prefill(self, tokens: np.ndarray, cache: KVCache, every_logit: bool = False) -> np.ndarray:
        """Run `tokens` after the cache's committed tokens, store their K/V; logits of the last one
        (every_logit: [T, vocab], one row per token, for teacher-forced scoring).

        A cache that evicts takes the prompt in chunks of PREFILL_CHUNK, so a prompt of any length
        (past the context, too) runs in bounded memory.
        """
        if not cache.evicts:
            return self._forward_sequence(tokens, cache, every_logit)
        chunks = [self._forward_sequence(tokens[i : i + PREFILL_CHUNK], cache, every_logit)
                  for i in range(0, len(tokens), PREFILL_CHUNK)]
        return np.concatenate(chunks) if every_logit else chunks[-1]

    def decode(
        self, token: int, pos: int, cache: KVCache, queries: list[np.ndarray] | None = None
    ) -> np.ndarray:
        """One token at position `pos`: append its K/V to the cache, attend over 0..pos; its logits.

        queries: when given, receives each layer's query row after RoPE (what kv-inspect shows).
        """
        if cache.length != pos:
            raise ValueError(f"decode at position {pos} but the cache holds {cache.length} tokens")
        c = self.config
        x = self._embed(np.array([token]))
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, kernels.rmsnorm(x, layer.attn_norm, c.rms_eps))
            kernels.rope_single_row(q[0], pos, c.n_heads, self.layer_inv_freq[i], c.rope_neox)
            kernels.rope_single_row(k[0], pos, c.n_kv_heads, self.layer_inv_freq[i], c.rope_neox)
            if queries is not None:
                queries.append(q[0])
            cache.write(i, pos, k, v)
            attn = cache.attend(i, q[0], pos + 1)
            x = x + self._post_norm(layer.wo.matmul(attn[None]), layer.post_attn_norm)
            x = x + self._mlp(layer, x)
        cache.commit(1)
        return self._logits(x)[0]

    def decode_batch(self, tokens: Sequence[int], caches: Sequence[KVCache]) -> np.ndarray:
        """One token for each of B sequences, token b at the position cache b holds next: logits [B, vocab].

        Each weight is read once for all B (quant_batch.batch_matmul); attention is per sequence over
        its own cache (one kernel call for paged sequences of one pool, see kv.batch).
        """
        c = self.config
        batch = batch_of(caches)
        x = self._embed(np.asarray(tokens))
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, kernels.rmsnorm(x, layer.attn_norm, c.rms_eps), batch_matmul)
            for b, pos in enumerate(batch.positions.tolist()):
                kernels.rope_single_row(q[b], pos, c.n_heads, self.layer_inv_freq[i], c.rope_neox)
                kernels.rope_single_row(k[b], pos, c.n_kv_heads, self.layer_inv_freq[i], c.rope_neox)
            batch.write(i, k, v)
            attn = batch.attend(i, q, c.n_heads)
            x = x + self._post_norm(batch_matmul(layer.wo, attn), layer.post_attn_norm)
            x = x + self._mlp(layer, x, batch_matmul)
        batch.commit()
        return self._logits(x, batch_matmul)

    # -- the naive path ------------------------------------------------------------------------

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        """The whole sequence from scratch, no cache: logits of the last token."""
        return self._forward_sequence(tokens, None)

    # -- pieces --------------------------------------------------------------------------------

    def _forward_sequence(
        self, tokens: np.ndarray, cache: KVCache | None, every_logit: bool = False
    ) -> np.ndarray:
        c = self.config
        start = cache.length if cache is not None else 0
        x = self._embed(np.asarray(tokens))
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, kernels.rmsnorm(x, layer.attn_norm, c.rms_eps))
            kernels.rope(q, start, c.n_heads, self.layer_inv_freq[i], c.rope_neox)
            kernels.rope(k, start, c.n_kv_heads, self.layer_inv_freq[i], c.rope_neox)
            if cache is None:
                attn = kernels.attention_prefill(q, k, v, c.n_heads, start, window=c.layer_windows[i])
            else:
                attn = cache.attend_new(i, start, q, k, v)
            x = x + self._post_norm(layer.wo.matmul(attn), layer.post_attn_norm)
            x = x + self._mlp(layer, x)
        if cache is not None:
            cache.commit(len(tokens))
        return self._logits(x) if every_logit else self._logits(x[-1:])[0]

    def _qkv(
        self, layer: Layer, h: np.ndarray, matmul: MatMul | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Projections of normed rows h [T, hidden] to q [T, q_width], k and v [T, kv_width]."""
        c = self.config
        q, k, v = layer.qkv(h, matmul)
        if layer.bq is not None:
            q += layer.bq
            k += layer.bk
            v += layer.bv
        if layer.q_norm is not None:
            kernels.rms_norm_heads(q, c.n_heads, layer.q_norm, c.rms_eps)
            kernels.rms_norm_heads(k, c.n_kv_heads, layer.k_norm, c.rms_eps)
        return q, k, v

    def _embed(self, tokens: np.ndarray) -> np.ndarray:
        x = self.embedding.rows_at(tokens)
        if self.config.embedding_scale != 1.0:
            x *= np.float32(self.config.embedding_scale)
        return x

    def _post_norm(self, out: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
        return out if weight is None else kernels.rmsnorm(out, weight, self.config.rms_eps)

    def _mlp(self, layer: Layer, x: np.ndarray, matmul: MatMul | None = None) -> np.ndarray:
        h = kernels.rmsnorm(x, layer.ffn_norm, self.config.rms_eps)
        gate, up = layer.gate_up(h, matmul)
        gated = ACTIVATIONS[self.config.ffn_activation](gate, up)
        return self._post_norm((matmul or QuantizedMatrix.matmul)(layer.w_down, gated), layer.post_ffn_norm)

    def _logits(self, x: np.ndarray, matmul: MatMul | None = None) -> np.ndarray:
        h = kernels.rmsnorm(x, self.output_norm, self.config.rms_eps)
        return (matmul or QuantizedMatrix.matmul)(self.output, h)


ACTIVATIONS = {"silu": kernels.silu_gate, "gelu_tanh": kernels.gelu_tanh_gate}
