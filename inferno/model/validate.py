"""The check between reading a GGUF and running any kernel: after it, the kernels can trust their inputs.

The kernels index arrays by the config's dimensions without checking (that is what makes them fast),
so a file whose metadata disagrees with its tensors would make them read and write outside their
arrays. Here every dimension is checked to be consistent, and every tensor the model reads to have
exactly the shape the config implies and a type we can compute with; anything else is one
InfernoError naming the tensor or key.

The expected shapes are tables keyed by tensor name: an architecture's tensors are a few lines here.
Weight values are checked where it is cheap: norm weights and biases (small float vectors) when the
model is built, the big matrices through the logits of every forward (`check_logits`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import TYPE_CHECKING

import gguf
import numpy as np
from gguf import GGUFReader

from inferno.errors import InfernoError
from inferno.file.config import ModelConfig
from inferno.kernels.quant import _check_supported as supported_type

if TYPE_CHECKING:
    from inferno.model.transformer import Transformer

Shape = Callable[[ModelConfig], tuple[int, ...]]  # in numpy order: [rows (out), cols (in)] or [n]


def _hidden(c: ModelConfig) -> tuple[int, ...]:
    return (c.hidden_size,)


def _kv_width(c: ModelConfig) -> int:
    return c.n_kv_heads * c.head_dim


# Tensors every architecture reads once, and once per layer (as blk.{i}.NAME).
GLOBAL_TENSORS: dict[str, Shape] = {
    "token_embd.weight": lambda c: (c.vocab_size, c.hidden_size),
    "output_norm.weight": _hidden,
}
LAYER_TENSORS: dict[str, Shape] = {
    "attn_norm.weight": _hidden,
    "attn_q.weight": lambda c: (c.q_width, c.hidden_size),
    "attn_k.weight": lambda c: (_kv_width(c), c.hidden_size),
    "attn_v.weight": lambda c: (_kv_width(c), c.hidden_size),
    "attn_output.weight": lambda c: (c.hidden_size, c.q_width),
    "ffn_norm.weight": _hidden,
    "ffn_gate.weight": lambda c: (c.ffn_size, c.hidden_size),
    "ffn_up.weight": lambda c: (c.ffn_size, c.hidden_size),
    "ffn_down.weight": lambda c: (c.hidden_size, c.ffn_size),
}
# Used when present (output.weight: untied embeddings).
OPTIONAL_GLOBAL_TENSORS: dict[str, Shape] = {
    "output.weight": lambda c: (c.vocab_size, c.hidden_size),
}
# Per-layer groups the model uses when all of a group is present, keyed by the ModelConfig flag
# that makes the group required.
LAYER_GROUPS: dict[str, dict[str, Shape]] = {
    "qkv_bias": {
        "attn_q.bias": lambda c: (c.q_width,),
        "attn_k.bias": lambda c: (_kv_width(c),),
        "attn_v.bias": lambda c: (_kv_width(c),),
    },
    "qk_norm": {
        "attn_q_norm.weight": lambda c: (c.head_dim,),
        "attn_k_norm.weight": lambda c: (c.head_dim,),
    },
}


def check_model_file(reader: GGUFReader, config: ModelConfig) -> None:
    """Refuse a file the model cannot run safely: inconsistent dimensions, or a tensor it reads that is
    missing or of the wrong shape or type, or a tokenizer with more tokens than the embedding has rows."""
    check_config(config)
    tensors = {t.name: t for t in reader.tensors}
    # Every layer has at least its LAYER_TENSORS: a block count beyond that is wrong, and looping
    # over it (2**63 layers) would never end.
    if config.n_layers * len(LAYER_TENSORS) > len(tensors):
        raise InfernoError(f"GGUF metadata says {config.n_layers} layers but the file has only "
                           f"{len(tensors)} tensors")
    for name, expected in expected_tensors(config, tensors).items():
        if name not in tensors:
            raise InfernoError(f"GGUF file has no tensor {name} ({config.architecture} needs it)")
        _check_tensor(tensors[name], expected(config))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    n_tokens = len(tokens.data) if tokens is not None else 0
    if n_tokens > config.vocab_size:
        raise InfernoError(f"the tokenizer has {n_tokens} tokens but the model only {config.vocab_size} "
                           "embedding rows")


def check_config(c: ModelConfig) -> None:
    """Every dimension positive and the dimensions consistent with each other."""
    for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size", "ffn_size", "vocab_size",
                 "rope_dim", "context_length"):
        if getattr(c, name) < 1:
            raise InfernoError(f"model {name} is {getattr(c, name)}, must be at least 1")
    if c.n_heads % c.n_kv_heads:
        raise InfernoError(f"{c.n_heads} query heads are not a multiple of {c.n_kv_heads} KV heads")
    if c.rope_dim % 2 or c.rope_dim > c.head_dim:
        raise InfernoError(f"RoPE dimension count {c.rope_dim} must be even and at most the head "
                           f"dimension {c.head_dim}")
    if not (math.isfinite(c.rope_base) and c.rope_base > 1):  # else the frequencies overflow
        raise InfernoError(f"RoPE frequency base {c.rope_base} must be a finite number above 1")
    if not (math.isfinite(c.rms_eps) and c.rms_eps > 0):
        raise InfernoError(f"RMSNorm epsilon {c.rms_eps} must be a positive number")


def check_finite_weights(model: Transformer) -> None:
    """The small float weights the model holds as arrays (norms, biases) hold no NaN or Inf."""
    arrays = {"output_norm": model.output_norm}
    for i, layer in enumerate(model.layers):
        for field in fields(layer):
            value = getattr(layer, field.name)
            if isinstance(value, np.ndarray):
                arrays[f"layer {i} {field.name}"] = value
    for name, array in arrays.items():
        if not np.isfinite(array).all():
            raise InfernoError(f"the model's {name} weights hold NaN or Inf values")


def check_logits(logits: np.ndarray, position: int) -> None:
    """Logits with NaN or Inf mean the weights do (or the arithmetic overflowed): never sample them."""
    if not np.isfinite(logits).all():
        raise InfernoError(NON_FINITE.format(position=position))


@contextmanager
def refusing_non_finite(position: int) -> Iterator[None]:
    """Around a forward: a division by zero in a kernel becomes the same error as non-finite logits.

    The kernels use Numba's default (Python) error model, which raises on a division by zero (wrapped
    in a SystemError when it happens inside a parallel loop). With validated inputs a divisor can only
    be zero once activations hold NaN or Inf, which the fastmath kernels assume they never do; that
    happens only with non-finite or huge weights. numpy's warnings about them are silenced: the
    logits check says it in one line.
    """
    try:
        with np.errstate(all="ignore"):
            yield
    except (ZeroDivisionError, SystemError) as exc:
        if not isinstance(exc, ZeroDivisionError) and not isinstance(exc.__context__, ZeroDivisionError):
            raise
        raise InfernoError(NON_FINITE.format(position=position)) from None


NON_FINITE = ("the model computed NaN or Inf at position {position} "
              "(its weights hold non-finite or huge values)")


def expected_tensors(config: ModelConfig, tensors: dict) -> dict[str, Shape]:
    expected = dict(GLOBAL_TENSORS)
    expected |= {name: shape for name, shape in OPTIONAL_GLOBAL_TENSORS.items() if name in tensors}
    for i in range(config.n_layers):
        layer = dict(LAYER_TENSORS)
        for flag, group in LAYER_GROUPS.items():
            present = [f"blk.{i}.{name}" in tensors for name in group]
            if getattr(config, flag) or any(present):
                layer |= group  # all of it: a partial group is as wrong as a missing one
        expected |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return expected


def _check_tensor(tensor: gguf.ReaderTensor, want: tuple[int, ...]) -> None:
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGML lists the contiguous dimension first
    if shape != want:
        raise InfernoError(f"tensor {tensor.name} has shape {list(shape)}, the model's config needs "
                           f"{list(want)}")
    qtype = supported_type(tensor)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:
        raise InfernoError(f"tensor {tensor.name}: row length {shape[-1]} is not a multiple of the "
                           f"{qtype.name} block size {block}")
