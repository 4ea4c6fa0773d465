"""GGUFs whose metadata disagrees with their tensors are refused before any kernel runs.

Each case is a tiny fixture model with one thing made wrong: the kinds of file that made the kernels
read and write outside their arrays, or raise, before the validation pass existed.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFValueType
from gguf_fuzz import FIXTURES, read_model, write_model

from inferno.errors import InfernoError
from inferno.runtime.engine import Engine


def field(model, key):
    return next(f for f in model.fields if f[0] == key)


def tensor(model, name):
    return next(t for t in model.tensors if t.name == name)


def set_int(key, value):
    def change(m):
        field(m, key)[1:] = [GGUFValueType.UINT32, value]
    return change


def set_shape(name, shape):
    def change(m):
        tensor(m, name).shape = shape  # GGML order
    return change


def set_value(key, vtype, value):
    def change(m):
        field(m, key)[1:] = [vtype, value]
    return change


def set_weight(name, value):
    def change(m):
        t = tensor(m, name)
        data = np.frombuffer(t.data, np.float32).copy()
        data[3] = value
        t.data = data.tobytes()
    return change


def drop_tokens(n):
    def change(m):
        # the embedding (and output) lose rows, and the metadata agrees; the tokenizer keeps its 320 tokens
        m.fields = [f for f in m.fields if f[0] != "llama.vocab_size"]
        for name in ("token_embd.weight", "output.weight"):
            t = tensor(m, name)
            t.shape = [t.shape[0], t.shape[1] - n]
            t.data = t.data[: len(t.data) * (t.shape[1]) // (t.shape[1] + n)]
    return change


CASES = {
    # tiny_llama: hidden 64, 4 heads, 2 KV heads, head_dim 16, ffn 128, vocab 320, F32 weights
    "rope dim above head dim": (set_int("llama.rope.dimension_count", 32), "RoPE dimension count 32"),
    "rope dim odd": (set_int("llama.rope.dimension_count", 15), "must be even"),
    "attn_k short of kv_heads x head_dim": (set_shape("blk.0.attn_k.weight", [64, 16]),
                                            "blk.0.attn_k.weight has shape [16, 64]"),
    "attn_norm shorter than hidden": (set_shape("blk.1.attn_norm.weight", [32]), "blk.1.attn_norm.weight"),
    "2-D norm": (set_shape("output_norm.weight", [32, 2]), "output_norm.weight has shape [2, 32]"),
    "dimension 0": (set_shape("blk.0.ffn_up.weight", [64, 0]), "blk.0.ffn_up.weight"),
    "projection dims swapped": (set_shape("blk.0.ffn_down.weight", [64, 128]),
                                "ffn_down.weight has shape [128, 64], the model's config needs [64, 128]"),
    "embedding smaller than the tokenizer": (drop_tokens(20), "tokenizer has 320 tokens"),
    "head_count 0": (set_int("llama.attention.head_count", 0), "head_count is 0"),
    "head_count_kv 0": (set_int("llama.attention.head_count_kv", 0), "head_count_kv is 0"),
    "kv heads do not divide heads": (set_int("llama.attention.head_count_kv", 3), "multiple of 3 KV heads"),
    "block_count 2**32+1": (set_value("llama.block_count", GGUFValueType.UINT64, 2**32 + 1),
                            "4294967297 layers"),
    "block_count as true or false": (set_value("llama.block_count", GGUFValueType.BOOL, True),
                                     "block_count should be an integer, not True"),
    "head counts as true or false": (
        set_value("llama.attention.head_count_kv", GGUFValueType.ARRAY, (GGUFValueType.BOOL, [True, True])),
        "head_count_kv is neither"),
    "epsilon as a string": (set_value("llama.attention.layer_norm_rms_epsilon", GGUFValueType.STRING, "1e-5"),
                            "layer_norm_rms_epsilon should be a number"),
    "epsilon 0": (set_value("llama.attention.layer_norm_rms_epsilon", GGUFValueType.FLOAT32, 0.0),
                  "epsilon 0.0"),
    "name not UTF-8": (set_value("general.architecture", GGUFValueType.STRING, b"ll\xffama"), "UTF-8"),
    "NaN in a norm": (set_weight("blk.0.ffn_norm.weight", np.nan), "layer 0 ffn_norm weights hold NaN"),
}


@pytest.mark.parametrize("case", CASES)
def test_inconsistent_file_is_refused_naming_the_problem(tmp_path, case):
    change, fragment = CASES[case]
    model = read_model(FIXTURES / "tiny_llama.gguf")
    change(model)
    path = tmp_path / "bad.gguf"
    path.write_bytes(write_model(model))
    with pytest.raises(InfernoError) as refused:
        Engine.load(path)
    assert fragment in str(refused.value)
    assert "\n" not in str(refused.value)


def test_nan_in_a_matrix_is_reported_as_such_not_sampled(tmp_path):
    model = read_model(FIXTURES / "tiny_llama.gguf")
    set_weight("output.weight", np.nan)(model)  # a matrix: checked through the logits
    path = tmp_path / "nan.gguf"
    path.write_bytes(write_model(model))
    with pytest.raises(InfernoError, match="NaN or Inf at position"):
        Engine.load(path)


def test_the_fixtures_themselves_pass():
    for name in ("tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_kquant"):
        engine = Engine.load(FIXTURES / f"{name}.gguf")
        assert len(engine.generate("Hello", 2, ignore_eos=True).token_ids) == 2
