"""The transformer: llama, qwen2, qwen3 and gemma3 in one readable forward.

`forward(tokens, caches, counts)` runs a ragged batch: each sequence brings its new tokens at the
positions its cache holds next, stores their K (after RoPE) and V, and attends over its cache. A
prompt, a decode step, B sequences' decode steps, and a prompt's chunk beside them are all that call;
`prefill` and `decode` are its one-sequence spellings, and with no cache it is the naive path (the
whole sequence, every step).

Weights stay in their GGUF type (`QuantizedMatrix`); activations are float32 throughout (the 4-bit
types' products split them into int8 parts exact to float32, unless `set_activations("int8")`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Protocol

import gguf
import numpy as np
from gguf import GGUFReader

from inferno.errors import InfernoError
from inferno.file.config import ModelConfig
from inferno.kernels import ops
from inferno.kernels.file_rows import FileRows
from inferno.kernels.quant import QuantizedMatrix, tensor_to_float32, uses_blas
from inferno.kernels.quant_batch import batch_matmul
from inferno.kernels.repack import IN_MEMORY, TileStore
from inferno.kv import KVCache
from inferno.model.ragged import Ragged
from inferno.model.validate import check_finite_weights, check_model_file

MatMul = Callable[[QuantizedMatrix, np.ndarray], np.ndarray]  # x [n, cols] -> [n, rows]

PREFILL_CHUNK = 512  # tokens per forward when prefilling into a cache that evicts
# Up to this many rows (a short prompt, a few sequences' decode steps, a chunk beside them) batch_matmul,
# reading each weight once for all rows, beats dequantizing every weight for BLAS (docs/benchmarks.md).
BATCH_ROWS = 64


class Projections:
    """Weights applied to the same input (q/k/v; gate/up). Those sharing a block type and row length
    are stacked into one QuantizedMatrix, so a decode step makes one kernel call for all of them."""

    def __init__(self, matrices: list[QuantizedMatrix], names: list[str]):
        """matrices: stacked weights holding, between them, the weights `names` (returned in that order)."""
        self.matrices = matrices
        place = {name: (m, p) for m, mat in enumerate(matrices) for p, name in enumerate(mat.part_names)}
        self._where = [place[name] for name in names]  # (matrix, part) holding each weight
        self._columns = [(m, slice(first, first + n))  # (matrix, its output's columns) of each weight
                         for m, p in self._where for first, n in [matrices[m].parts[p]]]

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
        return [np.ascontiguousarray(outs[m][:, columns]) for m, columns in self._columns]  # one row: no copy


def stack_tensors(tensors: list[gguf.ReaderTensor], store: TileStore = IN_MEMORY) -> list[QuantizedMatrix]:
    """The tensors as stacked matrices, one per block type and row length, in order of first appearance."""
    kinds: dict[tuple[int, int], list[gguf.ReaderTensor]] = {}
    for t in tensors:
        kinds.setdefault((int(t.tensor_type), int(t.shape[0])), []).append(t)
    return [QuantizedMatrix.from_tensors(members, store) for members in kinds.values()]


class Weights(Protocol):
    """Where a model's weights come from: the GGUF itself (`GGUFWeights`) or the prepared-model cache."""

    def has(self, name: str) -> bool: ...

    def vector(self, name: str) -> np.ndarray: ...

    def stacked(self, names: list[str]) -> list[QuantizedMatrix]: ...

    def rows(self, name: str) -> FileRows: ...


class GGUFWeights:
    """Weights read from the file: norms and biases as float32, matrices repacked into tiles. Keeps
    what it built (`built`, by tensor name or stacked name) for the prepared-model cache."""

    def __init__(self, reader: GGUFReader, config: ModelConfig, store: TileStore = IN_MEMORY):
        self._tensors = {t.name: t for t in reader.tensors}
        self._store = store
        self._architecture = config.architecture
        self.built: dict[str, np.ndarray | QuantizedMatrix | FileRows] = {}

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
        matrices = stack_tensors([self._tensor(name) for name in names], self._store)
        self.built |= {m.name: m for m in matrices}
        return matrices

    def rows(self, name: str) -> FileRows:
        self.built[name] = FileRows.from_tensor(self._tensor(name))
        return self.built[name]


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

    def matrices(self) -> list[QuantizedMatrix]:
        """The layer's weight matrices, in the order a forward multiplies by them."""
        return [*self.qkv.matrices, self.wo, *self.gate_up.matrices, self.w_down]


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
        embedding: QuantizedMatrix | FileRows,  # FileRows: untied, only looked up
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
        self.layer_rotary = [ops.Rotary(f, config.rope_neox) for f in self.layer_inv_freq]

    @classmethod
    def from_gguf(cls, reader: GGUFReader) -> Transformer:
        return cls.from_weights(*cls.weights_of(reader))

    @staticmethod
    def weights_of(reader: GGUFReader, store: TileStore = IN_MEMORY) -> tuple[ModelConfig, GGUFWeights]:
        """The file's config and its weights, once the file is checked to hold what the config needs.
        store: where the matrices' tiles are built (in memory by default)."""
        config = ModelConfig.from_gguf(reader)
        check_model_file(reader, config)
        return config, GGUFWeights(reader, config, store)

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
        if config.tied_embeddings:  # the output matrix: tiles
            embedding = output = matrix("token_embd.weight")
        else:  # only looked up: read in place
            embedding, output = weights.rows("token_embd.weight"), matrix("output.weight")
        model = cls(config, embedding, layers, weights.vector("output_norm.weight"), output)
        check_finite_weights(model)
        return model

    def layer_matrices(self) -> Iterator[QuantizedMatrix]:
        """The layers' weight matrices: those a long prompt's prefill multiplies through BLAS."""
        for layer in self.layers:
            yield from layer.matrices()

    def one_layer_of_each_kind(self) -> Transformer:
        """This model with only the first layer of each kind (its matrices' block types, which of its
        optional weights it has, sliding or global), sharing the weights: a forward of it runs every
        kernel a forward of the whole model runs, in a fraction of the time (what `warm_up` runs)."""
        first: dict[tuple, int] = {}
        for i in range(len(self.layers)):
            first.setdefault(self._layer_kind(i), i)
        keep = sorted(first.values())
        c = self.config
        config = replace(c, n_layers=len(keep), layer_windows=tuple(c.layer_windows[i] for i in keep),
                         layer_rope_bases=tuple(c.layer_rope_bases[i] for i in keep))
        layers = [self.layers[i] for i in keep]
        model = Transformer(config, self.embedding, layers, self.output_norm, self.output)
        model.activations = self.activations
        return model

    def _layer_kind(self, i: int) -> tuple:
        layer = self.layers[i]
        present = tuple(getattr(layer, f.name) is not None for f in fields(layer))
        blocks = tuple((m.qtype, len(m.parts)) for m in layer.matrices())
        return blocks, present, self.config.layer_windows[i] is None

    def set_activations(self, name: str) -> None:
        """How every matrix-vector product takes its activations (activation_parts.ACTIVATIONS): "f32",
        the default, keeps the float reference's tokens; "int8" rounds them as llama.cpp does."""
        for matrix in (*self.layer_matrices(), self.output):
            matrix.activations = name
        self.activations = name

    # -- the forward ---------------------------------------------------------------------------

    def forward(
        self,
        tokens: np.ndarray,
        caches: KVCache | Sequence[KVCache] | None = None,
        counts: Sequence[int] | None = None,
        every_logit: bool = False,
        queries: list[np.ndarray] | None = None,
    ) -> np.ndarray:
        """The one forward: a ragged batch of sequences, each bringing its new tokens.

        tokens [N]: sequence b's counts[b] new tokens, one sequence after another (counts default: one
        sequence of all N). Sequence b's tokens sit at the positions its cache holds next
        (caches[b].length ..), and their K/V are stored there. With no cache (None), one sequence is
        run from position 0 and attends over itself: the naive path. Prefill, decode, batched decode
        and a prefill chunk beside other sequences' decode tokens are all this call.

        Returns the logits of each sequence's last token [B, vocab] (a single cache given bare:
        [vocab]); every_logit: one row per token [N, vocab]. queries: receives each layer's query
        row after RoPE of the last token (what kv-inspect shows).
        """
        tokens = np.asarray(tokens)
        single = caches is None or isinstance(caches, KVCache)
        batch = Ragged([caches] if single else list(caches), counts or [len(tokens)])  # type: ignore[list-item]
        if batch.n_tokens != len(tokens):
            raise ValueError(f"{len(tokens)} tokens for sequences of {batch.counts} new tokens")
        matmul = self._matmul_for(batch.n_tokens)
        c = self.config
        x = self._embed(tokens)  # the residual stream [N, hidden]; each block's output is added in place
        h = ops.rmsnorm(x, self.layers[0].attn_norm, c.rms_eps)  # the next block's input, normed
        turns: dict[int, np.ndarray] = {}  # RoPE base's frequencies -> the tokens' rotations (ops.rotations)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, matmul)
            inv_freq = self.layer_inv_freq[i]
            if id(inv_freq) not in turns:
                turns[id(inv_freq)] = ops.rotations(batch.positions, inv_freq)
            ops.rotate(q, turns[id(inv_freq)], c.n_heads, c.rope_neox)
            ops.rotate(k, turns[id(inv_freq)], c.n_kv_heads, c.rope_neox)
            if queries is not None:
                queries.append(q[-1])
            attn = batch.attend(i, q, k, v, c.n_heads, c.layer_windows[i])
            out = self._post_norm((matmul or QuantizedMatrix.matmul)(layer.wo, attn), layer.post_attn_norm)
            h = ops.add_rmsnorm(x, out, layer.ffn_norm, c.rms_eps)
            following = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.output_norm
            h = ops.add_rmsnorm(x, self._mlp(layer, h, matmul), following, c.rms_eps)
        batch.commit()
        rows = h if every_logit else h[batch.last_rows]  # normed by the output norm
        logits = (self._matmul_for(len(rows)) or QuantizedMatrix.matmul)(self.output, rows)
        return logits[0] if single and not every_logit else logits

    def _matmul_for(self, n_rows: int) -> MatMul | None:
        """The product for x of n_rows rows: None for one row (matvec) and for many (BLAS on dequantized
        chunks), batch_matmul between, and for every row count with int8 activations, whose integer
        dots outrun dequantizing for BLAS at any size."""
        few = 1 < n_rows <= BATCH_ROWS or (n_rows > 1 and self.activations == "int8")
        return batch_matmul if few else None

    def prefill(self, tokens: np.ndarray, cache: KVCache, every_logit: bool = False) -> np.ndarray:
        """`tokens` after the cache's committed tokens: logits of the last one (every_logit: [T, vocab]).
        A cache that evicts takes them in chunks of PREFILL_CHUNK, so a prompt of any length (past the
        context, too) runs in bounded memory."""
        if not cache.evicts:
            return self.forward(tokens, cache, every_logit=every_logit)
        chunks = [self.forward(tokens[i : i + PREFILL_CHUNK], cache, every_logit=every_logit)
                  for i in range(0, len(tokens), PREFILL_CHUNK)]
        return np.concatenate(chunks) if every_logit else chunks[-1]

    def decode(
        self, token: int, pos: int, cache: KVCache, queries: list[np.ndarray] | None = None
    ) -> np.ndarray:
        """One token at position `pos` (the cache's length): its logits."""
        if cache.length != pos:
            raise ValueError(f"decode at position {pos} but the cache holds {cache.length} tokens")
        return self.forward(np.array([token]), cache, queries=queries)

    def decode_batch(self, tokens: Sequence[int], caches: Sequence[KVCache]) -> np.ndarray:
        """One token for each of B sequences: logits [B, vocab]."""
        return self.forward(np.asarray(tokens), caches, [1] * len(caches))

    # -- pieces --------------------------------------------------------------------------------

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
            ops.rms_norm_heads(q, c.n_heads, layer.q_norm, c.rms_eps)
            ops.rms_norm_heads(k, c.n_kv_heads, layer.k_norm, c.rms_eps)
        return q, k, v

    def _embed(self, tokens: np.ndarray) -> np.ndarray:
        x = self.embedding.rows_at(tokens)
        if self.config.embedding_scale != 1.0:
            x *= np.float32(self.config.embedding_scale)
        return x

    def _post_norm(self, out: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
        return out if weight is None else ops.rmsnorm(out, weight, self.config.rms_eps)

    def _mlp(self, layer: Layer, h: np.ndarray, matmul: MatMul | None = None) -> np.ndarray:
        """The MLP block's output for its normed input h [T, hidden]."""
        gate, up = layer.gate_up(h, matmul)
        gated = ops.gated(ACTIVATIONS[self.config.ffn_activation], gate, up)
        return self._post_norm((matmul or QuantizedMatrix.matmul)(layer.w_down, gated), layer.post_ffn_norm)


ACTIVATIONS = {"silu": ops.silu_gate, "gelu_tanh": ops.gelu_tanh_gate}
