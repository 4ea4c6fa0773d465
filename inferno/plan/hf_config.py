"""What a Hugging Face `config.json` says about a model's KV cache and weights.

A model too large to download can be sized from its config alone: layer count, query and KV heads,
head size, sliding-window layers (`layer_types`), multi-head latent attention (DeepSeek's
`kv_lora_rank`), and enough of the shape to count the parameters of llama-style dense models,
mixture-of-experts models and DeepSeek's MLA layers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferno.arguments import shown_path
from inferno.errors import InfernoError
from inferno.file.hparams import ARCH_SWA_PERIOD, MAX_LAYERS, ModelInfo, pattern_layers

MAX_CONFIG_BYTES = 16 * 2**20  # a config.json is a few KiB
MAX_COUNT = 2**53  # past any real count, and where JSON numbers stop being exact

# Bits per weight of each `torch_dtype` a config names.
TORCH_DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "float8_e4m3fn": 8}


@dataclass(frozen=True)
class Weights:
    """Bytes of a model's weights, by where pipeline parallelism places them."""

    embedding: int  # on the first stage
    output: int  # the output head, on the last stage (a copy of the embedding when tied)
    layers: tuple[int, ...]  # one per transformer layer
    tied: bool = False  # output head and embedding are one tensor

    @property
    def total(self) -> int:
        return self.embedding + (0 if self.tied else self.output) + sum(self.layers)


@dataclass(frozen=True)
class Params:
    """Parameter counts from the config; `weights(bits)` turns them into bytes."""

    embedding: int
    output: int
    layers: tuple[int, ...]
    tied: bool

    @property
    def total(self) -> int:
        return self.embedding + (0 if self.tied else self.output) + sum(self.layers)

    def weights(self, bits: int) -> Weights:
        return Weights(
            self.embedding * bits // 8,
            self.output * bits // 8,
            tuple(n * bits // 8 for n in self.layers),
            self.tied,
        )


@dataclass(frozen=True)
class HFModel:
    info: ModelInfo
    params: Params | None  # None: a layout whose parameters we do not know how to count
    weight_bits: int | None  # from quantization_config or torch_dtype; None when neither says


def read_hf_config(path: str | Path) -> HFModel:
    """Parse a config.json file; every problem is one InfernoError line."""
    path = Path(path)
    if os.path.isdir(path):
        raise InfernoError(f"{path} is a directory: pass its config.json")
    if os.path.exists(path) and not os.path.isfile(path):
        raise InfernoError(f"{path} is not a regular file (a FIFO or device): pass a config.json")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise InfernoError(f"{path.name} is more than {MAX_CONFIG_BYTES // 2**20} MiB: not a config")
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise InfernoError(f"no such file: {path}") from None
    except OSError as err:  # (a name too long: the name is not repeated in full)
        raise InfernoError(f"cannot read {shown_path(path)}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise InfernoError(f"cannot read {path}: {err}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise InfernoError(f"{path.name} is not valid JSON: {err.msg} at line {err.lineno}") from None
    except RecursionError:
        raise InfernoError(f"{path.name} nests arrays or objects too deeply to be a model config") from None
    except ValueError as err:  # a number past Python's 4,300-digit int conversion limit
        raise InfernoError(f"{path.name} holds a number too long to read: {str(err).split(':')[0]}") from None
    if not isinstance(config, dict):
        raise InfernoError(f"{path.name} is not a JSON object, so not a model config")
    return hf_model(config, path.name)


def hf_model(config: dict[str, Any], name: str = "config.json") -> HFModel:
    # Multimodal configs (Gemma 3, Llama 4, ...) keep the language model under text_config.
    text = config.get("text_config")
    c = Config({**config, **text} if isinstance(text, dict) else config, name)
    model_type = c.values.get("model_type", "unknown")
    if not isinstance(model_type, str):
        raise InfernoError(f"{name}: model_type must be a string, got {type(model_type).__name__}")
    try:
        model_type.encode("utf-8")
    except UnicodeEncodeError:
        raise InfernoError(f"{name}: model_type is not valid text (it holds a lone surrogate)") from None

    layers = c.positive("num_hidden_layers")
    if layers > MAX_LAYERS:
        raise InfernoError(f"{name}: num_hidden_layers must be at most {MAX_LAYERS:,}, got {layers:,}")
    heads = c.positive("num_attention_heads")
    hidden = c.optional("hidden_size")
    mla = c.optional("kv_lora_rank") is not None
    if mla:
        # The cache holds the compressed latent and the RoPE part of the key, once per token, for all
        # heads (vLLM: MLACommonImpl; SGLang: profile_max_num_token, kv_lora_rank + qk_rope_head_dim).
        head_dim = c.positive("kv_lora_rank") + c.positive("qk_rope_head_dim")
        kv_heads: int | tuple[int, ...] = 1
    else:
        kv_heads = c.per_layer("num_key_value_heads", layers, default=heads)
        head_dim = c.optional("head_dim")
        if head_dim is None:
            if hidden is None:
                raise InfernoError(f"{name} has neither head_dim nor hidden_size")
            if hidden % heads:
                raise InfernoError(f"{name}: hidden_size {hidden} is not a multiple of {heads} heads")
            head_dim = hidden // heads
    window, sliding = _sliding(c, layers)
    kv = kv_heads if isinstance(kv_heads, tuple) else (kv_heads,) * layers
    info = ModelInfo(
        arch=str(config.get("model_type", "unknown")),
        layers=layers,
        kv_heads=kv,
        heads=(heads,) * layers,
        head_dim=head_dim,
        context_length=c.optional("max_position_embeddings"),
        window=window,
        sliding=sliding,
        mla=mla,
    )
    return HFModel(info, _params(c, layers, heads, kv, head_dim, mla), _weight_bits(config, name))


class Config:
    """Typed access to a config's keys, each failure one line naming the file and key."""

    def __init__(self, values: dict[str, Any], name: str) -> None:
        self.values = values
        self.name = name

    def optional(self, key: str) -> Any:
        value = self.values.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise InfernoError(f"{self.name}: {key} must be a whole number, got {_shown(value)}")
        if value is not None and value > MAX_COUNT:
            raise InfernoError(f"{self.name}: {key} is too large ({len(str(value))} digits)")
        return value

    def positive(self, key: str) -> int:
        value = self.optional(key)
        if value is None:
            raise InfernoError(f"{self.name} has no {key}")
        if value < 1:
            raise InfernoError(f"{self.name}: {key} must be at least 1, got {value}")
        return value

    def per_layer(self, key: str, layers: int, default: int) -> int | tuple[int, ...]:
        value = self.values.get(key)
        if isinstance(value, list):
            bad = [v for v in value
                   if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT]
            if len(value) != layers or bad:
                raise InfernoError(f"{self.name}: {key} must be one integer or one per layer ({layers})")
            return tuple(value)
        return default if value is None else self.positive(key)


def _sliding(c: Config, layers: int) -> tuple[int | None, frozenset[int] | None]:
    """The window and which layers use it, as transformers' config classes decide."""
    window = c.values.get("sliding_window")
    if window is None or c.values.get("use_sliding_window") is False:
        return None, None  # Qwen2 configs carry a window that is off unless use_sliding_window
    window = c.positive("sliding_window")
    types = c.values.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise InfernoError(f"{c.name}: layer_types must list one type per layer ({layers})")
        return window, frozenset(i for i, layer_type in enumerate(types) if layer_type == "sliding_attention")
    model_type = c.values.get("model_type", "")
    period = c.values.get("sliding_window_pattern") or ARCH_SWA_PERIOD.get(model_type.removesuffix("_text"))
    if isinstance(period, int) and period > 0:
        return window, pattern_layers(layers, period)
    if model_type in ("mistral", "mixtral"):
        return window, frozenset(range(layers))  # one window for every layer
    return window, None


def _weight_bits(config: dict[str, Any], name: str) -> int | None:
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        if quant.get("quant_method") == "fp8":
            return 8
        bits = quant.get("bits")
        if isinstance(bits, int) and not isinstance(bits, bool) and bits > 0:
            return bits
        return None  # a scheme we cannot size: the caller asks for --weight-dtype
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype is None:
        return None
    if not isinstance(dtype, str) or dtype not in TORCH_DTYPE_BITS:
        raise InfernoError(f"{name}: torch_dtype {_shown(dtype)} is not one of {', '.join(TORCH_DTYPE_BITS)}")
    return TORCH_DTYPE_BITS[dtype]


def _shown(value: Any) -> str:
    """A config value in a message: short, and printable even when it holds a lone surrogate."""
    if isinstance(value, int) and value.bit_length() >= 1000:
        return f"<a {value.bit_length():,}-bit number>"
    text = ascii(value)
    return text if len(text) <= 60 else text[:57] + "..."


# The counts _params reads besides the attention's: whole numbers when present.
COUNT_KEYS = ("hidden_size", "vocab_size", "intermediate_size", "n_routed_experts", "num_local_experts",
              "num_experts", "moe_intermediate_size", "n_shared_experts", "shared_expert_intermediate_size",
              "first_k_dense_replace")


def _params(
    c: Config, layers: int, heads: int, kv: tuple[int, ...], head_dim: int, mla: bool
) -> Params | None:
    """Parameters of a llama-style decoder: attention, MLP or experts, two norms per layer.

    None when a key the count needs is absent: the caller then asks for --weights.
    Biases (Qwen2's q/k/v) are not counted: under 0.01% of any such model.
    """
    v = {key: c.optional(key) for key in COUNT_KEYS}  # each a whole number or absent, else refused
    hidden, vocab = v["hidden_size"], v["vocab_size"]
    if hidden is None or vocab is None:
        return None
    if mla:
        nope, rope = c.positive("qk_nope_head_dim"), c.positive("qk_rope_head_dim")
        latent, v_dim = c.positive("kv_lora_rank"), c.positive("v_head_dim")
        q_rank = c.optional("q_lora_rank")
        q_width = heads * (nope + rope)
        q = hidden * q_width if not q_rank else hidden * q_rank + q_rank + q_rank * q_width
        kv_proj = hidden * (latent + rope) + latent + latent * heads * (nope + v_dim)
        attention = [q + kv_proj + heads * v_dim * hidden] * layers
    else:
        attention = [hidden * head_dim * (2 * heads + 2 * k) for k in kv]

    experts = v.get("n_routed_experts") or v.get("num_local_experts") or v.get("num_experts")
    dense = v.get("intermediate_size")
    if experts:
        expert_size = v.get("moe_intermediate_size") or dense
        if not isinstance(expert_size, int):
            return None
        shared = (v.get("n_shared_experts") or 0) * 3 * hidden * expert_size
        shared += 3 * hidden * (v.get("shared_expert_intermediate_size") or 0)
        moe = experts * 3 * hidden * expert_size + hidden * experts + shared
        first_dense = v.get("first_k_dense_replace") or 0  # DeepSeek: the first layers are dense
        if first_dense and not isinstance(dense, int):
            return None
        mlp = [3 * hidden * dense if i < first_dense else moe for i in range(layers)]
    elif isinstance(dense, int):
        mlp = [3 * hidden * dense] * layers
    else:
        return None
    per_layer = [a + m + 2 * hidden for a, m in zip(attention, mlp, strict=True)]
    per_layer[-1] += hidden  # the final norm, on the last stage
    tied = c.values.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise InfernoError(f"{c.name}: tie_word_embeddings must be true or false, got {_shown(tied)}")
    return Params(vocab * hidden, vocab * hidden, tuple(per_layer), tied)
