"""What kv-memcalc computes, as plain data: the model's shape read from a GGUF, the report's figures
for each context (or, with --kv, what inferno's own cache allocates), the deployment across GPUs.
`inferno.cli.memcalc` parses the flags and prints what these return."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from inferno.errors import InfernoError
from inferno.file.config import ModelConfig
from inferno.file.hparams import ModelInfo, read_model_info
from inferno.file.reader import open_gguf
from inferno.kv import cache_class, planned_nbytes
from inferno.kv.dtypes import ElementType
from inferno.kv.geometry import KVGeometry
from inferno.plan.deploy import Devices, engine_plans, limiting, plan_stages
from inferno.plan.hf_config import HFModel, Weights
from inferno.plan.memcalc import (
    bytes_per_token,
    bytes_per_token_beyond_window,
    cache_bytes,
    heads_by_layer,
    kv_heads_by_layer,
    layer_token_bytes,
    longest_window,
    max_batch,
    max_context,
    parse_size,
    sliding_indices,
)

BINARY = (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
DECIMAL = (("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def human(n: int, units: tuple[tuple[str, int], ...] = BINARY) -> str:
    for name, size in units:
        if n >= size:
            whole = n // size
            if whole >= 10**15:  # nothing holds that much: the count in powers of ten (floats overflow)
                exponent = math.floor(math.log10(whole))
                return f"{whole / 10**exponent:.2f}e{exponent} {name}"
            return f"{n / size:.2f} {name}"
    return f"{n} B"



def read_model(path: str) -> tuple[ModelInfo, Weights]:
    """What a GGUF's metadata says of the attention, as `ModelConfig` reads it, and its tensors' bytes."""
    reader = open_gguf(path)
    info = read_model_info(reader)
    return info, gguf_weights(reader, info.layers)


def gguf_weights(reader: Any, layers: int) -> Weights:
    """The file's tensor bytes (quantized as stored), by layer, embedding and output head."""
    embedding = output = 0
    per_layer = [0] * layers
    for tensor in reader.tensors:
        size = int(tensor.n_bytes)
        if tensor.name.startswith("blk."):
            index = int(tensor.name.split(".")[1])
            per_layer[min(index, layers - 1)] += size
        elif tensor.name.startswith("token_embd"):
            embedding += size
        else:
            output += size  # output.weight and output_norm
    return Weights(embedding, output, tuple(per_layer))


# --weight-dtype: bits per parameter when sizing weights from a config's parameter count.
WEIGHT_BITS = {"f32": 32, "f16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}


def deployment_weights(
    weights: Weights | None, hf: HFModel | None, weight_dtype: str | None, total: str | None, layers: int
) -> Weights:
    """The weights to place on the GPUs: --weights, a config's parameters x a dtype, or a GGUF's tensors."""
    if total is not None:
        size = parse_size(total)
        # Spread over the layers: fine for TP, and for PP off by the embedding and head at most.
        return Weights(0, 0, tuple(size * (i + 1) // layers - size * i // layers for i in range(layers)))
    if hf is not None:
        if hf.params is None:
            raise InfernoError(
                f"cannot count a {hf.info.arch!r} model's parameters from its config: pass --weights SIZE"
            )
        bits = WEIGHT_BITS[weight_dtype.lower()] if weight_dtype else hf.weight_bits
        if bits is None:
            raise InfernoError("the config names no torch_dtype or known quantization: pass --weight-dtype")
        weights = hf.params.weights(bits)
    elif weights is not None:
        if weight_dtype is not None:
            raise InfernoError("--weight-dtype sizes a config's parameters; a GGUF's weights are its tensors")
    else:
        raise InfernoError("a deployment needs the weights: give --config, --model or --weights SIZE")
    if len(weights.layers) != layers:
        raise InfernoError(f"--layers {layers} is not the model's {len(weights.layers)}: give --weights SIZE")
    return weights


def build_deployment(
    shape: KVGeometry, dtype: ElementType, weights: Weights, dev: Devices, context: int, gguf: str | None,
    model_context: int | None = None,
) -> dict[str, Any]:
    stages = plan_stages(shape, dtype, weights, dev, context)
    usable = int(dev.memory * dev.utilization)
    for stage in stages:
        if stage.weight_bytes + dev.overhead >= usable:
            reserve = f" + {human(dev.overhead)} --overhead" if dev.overhead else ""
            raise InfernoError(
                f"does not fit: {human(stage.weight_bytes)} of weights per GPU{reserve} leave no room for a "
                f"cache in the {human(usable)} usable of each {human(dev.memory)} GPU (utilization "
                f"{dev.utilization:g}): use more GPUs, a smaller --weight-dtype or a larger --gpus size"
            )
    if model_context:
        stages = [replace(s, max_context=min(s.max_context, model_context)) if s.max_context else s
                  for s in stages]  # fmt: skip
    worst = limiting(stages)

    def stage_report(stage: Any) -> dict[str, Any]:
        return {
            "layers": [stage.layers.start, stage.layers.stop],
            "weight_bytes": stage.weight_bytes,
            "kv_bytes_per_token": stage.kv_bytes_per_token,
            "cache_bytes": stage.cache_bytes,
            "blocks": stage.blocks,
            "max_context": stage.max_context,
            "max_batch": stage.max_batch,
        }

    return {
        "gpus": dev.count,
        "gpu_memory": dev.memory,
        "tp": dev.tp,
        "pp": dev.pp,
        "gpu_memory_utilization": dev.utilization,
        "overhead": dev.overhead,
        "block_size": dev.block_size,
        "context": context,
        "weight_bytes": weights.total,
        "stages": [stage_report(stage) for stage in stages],
        "per_gpu": stage_report(worst),
        "engines": engine_plans(shape, dtype, dev, worst, context, "MODEL", gguf or "MODEL.gguf"),
    }


def build_report(
    shape: KVGeometry,
    dtype: ElementType,
    contexts: list[int],
    batch: int,
    budget: int | None,
    show_mha: bool,
) -> dict[str, Any]:
    """Everything kv-memcalc says, as plain data: printed as JSON or rendered as text."""
    per_layer = layer_token_bytes(shape, dtype)
    report: dict[str, Any] = {
        "layers": shape.layers,
        "kv_heads": _scalar(kv_heads_by_layer(shape)),
        "head_dim": shape.head_dim,
        "dtype": dtype.name,
        "batch": batch,
        "bytes_per_token": bytes_per_token(shape, dtype),
        "bytes_per_token_per_layer": _scalar(tuple(per_layer)),
    }
    if shape.mla:
        report["mla"] = True
    if shape.sliding:
        report["sliding_window"] = longest_window(shape)
        report["sliding_layers"] = sliding_indices(shape)
        report["bytes_per_token_beyond_window"] = bytes_per_token_beyond_window(shape, dtype)
    if show_mha:
        report["heads"] = _scalar(heads_by_layer(shape))
        report["mha_bytes_per_token"] = bytes_per_token(shape, dtype, mha=True)
    rows = []
    for context in contexts:
        row = {"context": context, "batch": batch, "dtype": dtype.name}
        row["bytes"] = cache_bytes(shape, dtype, context, batch)
        if show_mha:
            row["mha_bytes"] = cache_bytes(shape, dtype, context, batch, mha=True)
        if budget is not None:
            row["max_batch"] = max_batch(shape, dtype, budget, context)
        rows.append(row)
    report["rows"] = rows
    if budget is not None:
        report["budget"] = budget
        report["max_context"] = max_context(shape, dtype, budget, batch)
        # The batch that fits every context asked about: the one at the longest context.
        report["max_batch"] = min(row["max_batch"] for row in rows)
    return report


def runtime_bytes(
    report: dict[str, Any], model_path: str | None, layout: str, dtype: str, window: int | None = None
) -> None:
    """Replace the report's bytes with what `model-generate --kv layout --kv-dtype dtype --max-context N`
    (and `--window W` for --kv window: `--sliding-window W` here) allocates for this model: the cache's
    own planned_nbytes, so the two always agree."""
    if model_path is None:
        raise InfernoError("--kv and --kv-dtype size inferno's cache of a model: give --model FILE.gguf")
    geometry = ModelConfig.from_gguf(open_gguf(model_path)).kv_geometry
    options = {"window": window} if layout == "window" and window else {}
    report |= {"kv": layout, "dtype": dtype}
    if not cache_class(layout).evicts:  # a window cache stops growing: its per-token figure is the formula's
        per_token = planned_nbytes(layout, geometry, 1, dtype)
        report |= {"bytes_per_token": per_token, "bytes_per_token_per_layer": per_token // geometry.layers}
    report.pop("heads", None)  # the multi-head comparison is the formula's, not this cache's
    for row in report["rows"]:
        row.pop("mha_bytes", None)
        row["dtype"] = dtype
        row["bytes"] = planned_nbytes(layout, geometry, row["context"], dtype, **options) * row["batch"]


def _scalar(values: tuple[int, ...]) -> int | list[int]:
    return values[0] if len(set(values)) == 1 else list(values)
