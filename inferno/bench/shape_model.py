"""A GGUF of a given shape built from a real model's blocks, for measuring speed on a model size that is
not at hand: `python -m inferno.bench.shape_model SOURCE OUT` (a qwen2 Q4_K_M file in, by default the
shape of Qwen2.5-1.5B out).

Speed does not depend on the weights' values, only on their shapes and block types: every matrix is
filled with blocks drawn from SOURCE's matrices of the same type (real scales and nibbles), norms are
ones and biases zeros. The text it generates is noise. Block types follow llama.cpp's Q4_K_M preset:
Q4_K everywhere but attn_v and ffn_down, which are Q6_K in every other layer, and the output (Q6_K).
The tokenizer and chat template are SOURCE's."""

from __future__ import annotations

import argparse

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

SHAPES = {  # name: (layers, hidden, ffn, heads, kv_heads, vocab)
    "qwen2.5-1.5b": (28, 1536, 8960, 12, 2, 151936),
    "qwen2.5-0.5b": (24, 896, 4864, 14, 2, 151936),
    "tiny": (2, 256, 256, 4, 2, 320),  # the K-quant fixture the GGUF fuzzer mutates (tokenizer: tiny_qwen2's)
}


def block_pool(reader: gguf.GGUFReader, qtype: QType) -> np.ndarray:
    """Every block of `qtype` in the source's matrices: uint8[blocks, type_size]."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    found = [np.asarray(t.data).view(np.uint8).reshape(-1, size) for t in reader.tensors
             if t.tensor_type == qtype and len(t.shape) == 2]
    if not found:
        raise SystemExit(f"shape_model: the source has no {qtype.name} matrices to draw blocks from")
    return np.concatenate(found)


def matrix(pools: dict, qtype: QType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8[rows, bytes per row] of `qtype` blocks drawn from the source."""
    per_row = cols // gguf.GGML_QUANT_SIZES[qtype][0]
    pick = rng.integers(0, len(pools[qtype]), rows * per_row)
    return pools[qtype][pick].reshape(rows, -1)


def build(source: str, out: str, shape: str, seed: int = 0, tokenizer: str | None = None) -> None:
    """tokenizer: a GGUF whose tokenizer and chat template the model gets (default: SOURCE's); its
    vocabulary must be the shape's."""
    layers, hidden, ffn, heads, kv_heads, vocab = SHAPES[shape]
    head_dim = hidden // heads
    reader = gguf.GGUFReader(source)
    pools = {q: block_pool(reader, q) for q in (QType.Q4_K, QType.Q6_K)}
    words = gguf.GGUFReader(tokenizer) if tokenizer else reader
    rng = np.random.default_rng(seed)
    arch = "qwen2"
    writer = gguf.GGUFWriter(out, arch=arch)
    writer.add_name(f"{shape} shape (blocks of {source.rsplit('/', 1)[-1]})")
    writer.add_block_count(layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    for key, field in words.fields.items():  # the tokenizer and chat template
        if key.startswith("tokenizer."):
            value = field.contents()
            value_type = field.types[0]
            if value_type == gguf.GGUFValueType.ARRAY:
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, value_type)

    def add(name: str, qtype: QType, rows: int, cols: int) -> None:
        writer.add_tensor(name, matrix(pools, qtype, rows, cols, rng), raw_dtype=qtype)

    ones, zeros = np.ones(hidden, np.float32), np.zeros
    add("token_embd.weight", QType.Q4_K, vocab, hidden)
    for i in range(layers):
        more_bits = QType.Q6_K if i % 2 == 0 else QType.Q4_K
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        add(p + "attn_q.weight", QType.Q4_K, hidden, hidden)
        add(p + "attn_k.weight", QType.Q4_K, kv_heads * head_dim, hidden)
        add(p + "attn_v.weight", more_bits, kv_heads * head_dim, hidden)
        writer.add_tensor(p + "attn_q.bias", zeros(hidden, np.float32))
        writer.add_tensor(p + "attn_k.bias", zeros(kv_heads * head_dim, np.float32))
        writer.add_tensor(p + "attn_v.bias", zeros(kv_heads * head_dim, np.float32))
        add(p + "attn_output.weight", QType.Q4_K, hidden, hidden)
        writer.add_tensor(p + "ffn_norm.weight", ones)
        add(p + "ffn_gate.weight", QType.Q4_K, ffn, hidden)
        add(p + "ffn_up.weight", QType.Q4_K, ffn, hidden)
        add(p + "ffn_down.weight", more_bits, hidden, ffn)
    writer.add_tensor("output_norm.weight", ones)
    add("output.weight", QType.Q6_K, vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a qwen2 Q4_K_M GGUF whose blocks and tokenizer are used")
    parser.add_argument("out", help="the GGUF to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="a GGUF whose tokenizer to use instead of the source's")
    args = parser.parse_args()
    build(args.source, args.out, args.shape, args.seed, args.tokenizer)


if __name__ == "__main__":
    main()
