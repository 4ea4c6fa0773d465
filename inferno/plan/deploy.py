"""The memory plan of a deployment across GPUs, and the same plan in vLLM's, SGLang's and llama.cpp's terms.

Tensor parallelism (TP) splits every layer's heads and weights across ranks; pipeline parallelism (PP)
gives each stage a run of whole layers. Per device, what is left of `memory x utilization` after the
weights and an activation reserve holds the cache, in blocks of `block_size` tokens across the
device's layers, as paged engines allocate it. Pure arithmetic, like `inferno.plan.memcalc`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from inferno.errors import InfernoError
from inferno.kv.dtypes import ElementType
from inferno.kv.geometry import KVGeometry
from inferno.plan.hf_config import Weights
from inferno.plan.memcalc import (
    bytes_per_token,
    heads_by_layer,
    kv_heads_by_layer,
    max_batch,
    max_context,
    parse_size,
)

# Engine spellings of the KV dtypes each supports; f16/bf16 are the engines' default ("auto": the
# model's own 16-bit type), so they need no flag.
VLLM_KV_DTYPES = {"f16": None, "bf16": None, "fp8": "fp8"}
SGLANG_KV_DTYPES = {"f16": None, "bf16": None, "fp8": "fp8_e4m3"}
LLAMA_CPP_KV_DTYPES = {"f16": None, "bf16": "bf16", "f32": "f32", "q8_0": "q8_0", "q4_0": "q4_0"}


@dataclass(frozen=True)
class Devices:
    count: int
    memory: int  # bytes per GPU
    tp: int
    pp: int
    utilization: float  # fraction of each GPU's memory the engine may use
    overhead: int  # bytes per GPU for activations, CUDA graphs, NCCL: what vLLM's profile run measures
    block_size: int


_GPUS = re.compile(r"\s*(?:(\d+)\s*[x*]\s*)?(.+)", re.IGNORECASE)


def parse_gpus(text: str) -> tuple[int, int]:
    """`4x80GiB` -> (4, 80 GiB in bytes); `80GB` alone is one GPU."""
    match = _GPUS.fullmatch(text)
    if not match or not match.group(2).strip() or match.group(2).strip()[0] in "x*":
        raise InfernoError(f"--gpus {text!r} is not understood: use e.g. 4x80GiB, 8x141GB or 24GiB")
    count = int(match.group(1)) if match.group(1) else 1
    if count < 1:
        raise InfernoError(f"--gpus {text!r} asks for {count} GPUs")
    return count, parse_size(_with_unit("--gpus", text, match.group(2)))


def _with_unit(flag: str, text: str, size: str) -> str:
    """A GPU's memory with its unit: `80` alone (80 bytes) is surely a mistake for 80GiB or 80GB."""
    if size.strip().replace("_", "").isdigit():
        raise InfernoError(f"{flag} {text!r} has no unit: write e.g. {size.strip()}GiB or {size.strip()}GB")
    return size


def devices(
    gpus: str | None,
    gpu_memory: str | None,
    tp: int | None,
    pp: int | None,
    utilization: float,
    overhead: int,
    block_size: int,
) -> Devices:
    """Validate the device flags; TP defaults to every GPU of --gpus not taken by PP."""
    if gpus is not None and gpu_memory is not None:
        raise InfernoError("give --gpus COUNTxSIZE or --gpu-memory SIZE, not both")
    if gpus is not None:
        count, memory = parse_gpus(gpus)
    elif gpu_memory is not None:
        count, memory = None, parse_size(_with_unit("--gpu-memory", gpu_memory, gpu_memory))
    else:
        raise InfernoError("a deployment needs --gpus (e.g. 4x80GiB) or --gpu-memory")
    if not 0 < utilization <= 1:
        raise InfernoError(f"--gpu-memory-utilization must be above 0 and at most 1, got {utilization}")
    pp = pp or 1
    if tp is None:
        if count is not None and count % pp:
            raise InfernoError(f"--pp {pp} does not divide the {count} GPUs of --gpus")
        tp = count // pp if count is not None else 1
    if count is None:
        count = tp * pp
    elif tp * pp != count:
        raise InfernoError(f"--tp {tp} x --pp {pp} uses {tp * pp} GPUs, but --gpus has {count}")
    return Devices(count, memory, tp, pp, utilization, overhead, block_size)


def pp_stages(layers: int, pp: int) -> list[range]:
    """The layers of each pipeline stage, as vLLM's get_pp_indices (vllm/distributed/utils.py) splits
    them: evenly, the remainder going one each to the stages before the last, counted backwards."""
    if pp > layers:
        raise InfernoError(f"--pp {pp} is more pipeline stages than the model's {layers} layers")
    sizes = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def device_shape(shape: KVGeometry, tp: int, layers: range) -> KVGeometry:
    """The cache one TP rank of one stage holds.

    KV heads are divided across ranks, and replicated when there are fewer KV heads than ranks
    (vLLM's ModelConfig.get_num_kv_heads: max(1, total // tp)); MLA's latent is one row every rank
    keeps whole (get_num_kv_heads returns 1 under use_mla).
    """
    all_kv, all_heads = kv_heads_by_layer(shape), heads_by_layer(shape)
    kv_heads = []
    for i in layers:
        kv, heads = all_kv[i], all_heads[i]
        if heads and heads % tp:  # 0: query heads not known
            raise InfernoError(f"--tp {tp} does not divide the model's {heads} attention heads")
        if shape.mla or kv == 0:
            kv_heads.append(kv)
        elif kv >= tp:
            if kv % tp:
                raise InfernoError(f"--tp {tp} does not divide the model's {kv} KV heads")
            kv_heads.append(kv // tp)
        else:
            if tp % kv:
                raise InfernoError(f"--tp {tp} is not a multiple of the model's {kv} KV heads")
            kv_heads.append(1)
    heads = tuple(all_heads[i] // tp for i in layers)
    windows = shape.windows[layers.start : layers.stop]
    return KVGeometry(len(layers), max(kv_heads), max(heads), shape.head_dim, windows, tuple(kv_heads), heads,
                      shape.mla)


def stage_weight_bytes(weights: Weights, layers: range, first: bool, last: bool, tp: int) -> int:
    """Weights on one rank: its stage's layers plus the embedding (first stage) and output head (last),
    all divided across TP ranks (norms, a few KiB per layer, are counted divided too)."""
    total = sum(weights.layers[layers.start : layers.stop])
    if first:
        total += weights.embedding
    if last and not (weights.tied and first):  # tied: one tensor when one stage holds both ends
        total += weights.output
    return -(-total // tp)


def ceil_to_block(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) * block_size


@dataclass(frozen=True)
class StagePlan:
    layers: range
    weight_bytes: int
    kv_bytes_per_token: int
    cache_bytes: int  # what is left for the cache on each of this stage's GPUs
    blocks: int
    max_context: int | None  # at batch 1; None: only sliding layers, so any length fits
    max_batch: int  # at the context asked about


def plan_stages(
    shape: KVGeometry, dtype: ElementType, weights: Weights, dev: Devices, context: int
) -> list[StagePlan]:
    stages = pp_stages(shape.layers, dev.pp)
    plans = []
    for n, layers in enumerate(stages):
        rank = device_shape(shape, dev.tp, layers)
        weight = stage_weight_bytes(weights, layers, n == 0, n == len(stages) - 1, dev.tp)
        # vLLM's rule (Worker.determine_num_available_blocks, V1 determine_available_memory):
        # total_gpu_memory x gpu_memory_utilization - peak non-cache memory (weights + profile).
        budget = max(0, int(dev.memory * dev.utilization) - weight - dev.overhead)
        per_token = bytes_per_token(rank, dtype)
        blocks = budget // (dev.block_size * per_token) if per_token else 0
        if rank.sliding:
            longest = max_context(rank, dtype, budget, 1)
            longest = None if longest is None else longest // dev.block_size * dev.block_size
        else:
            longest = blocks * dev.block_size
        batch = max_batch(rank, dtype, budget, ceil_to_block(context, dev.block_size)) if per_token else 0
        plans.append(StagePlan(layers, weight, per_token, budget, blocks, longest, batch))
    return plans


def limiting(stages: list[StagePlan]) -> StagePlan:
    """The stage that holds least: every engine sizes its cache by the smallest worker (vLLM's
    get_kv_cache_configs takes the minimum num_blocks over workers)."""
    return min(stages, key=lambda s: (s.max_batch, s.blocks))


def engine_plans(
    shape: KVGeometry, dtype: ElementType, dev: Devices, stage: StagePlan, context: int, model: str, gguf: str
) -> dict[str, dict[str, Any]]:
    """Flags for each engine, and what each would report for them (None where it does not apply)."""
    plans: dict[str, dict[str, Any]] = {}
    if dtype.name in VLLM_KV_DTYPES:
        args = ["vllm", "serve", model, "--tensor-parallel-size", str(dev.tp)]
        if dev.pp > 1:
            args += ["--pipeline-parallel-size", str(dev.pp)]
        args += ["--gpu-memory-utilization", f"{dev.utilization:g}", "--max-model-len", str(context)]
        if dev.block_size != 16:
            args += ["--block-size", str(dev.block_size)]
        if VLLM_KV_DTYPES[dtype.name]:
            args += ["--kv-cache-dtype", VLLM_KV_DTYPES[dtype.name]]
        vllm: dict[str, Any] = {"args": args}
        if shape.sliding:
            # vLLM's hybrid allocator pages sliding and full layers in separate groups
            # (_get_kv_cache_groups_uniform_page_size); its count is not modelled here.
            vllm["num_gpu_blocks"] = None
        else:
            # V1 get_num_blocks: available_memory // page_size // num_layers, with page_size =
            # (2, or 1 for MLA) x block_size x kv_heads x head_size x dtype size (kv_cache_interface
            # AttentionSpec.page_size_bytes): the same as budget // (block_size x bytes per token).
            blocks_per_request = -(-context // dev.block_size)
            vllm["num_gpu_blocks"] = stage.blocks
            vllm["kv_cache_tokens"] = stage.blocks * dev.block_size  # "GPU KV cache size: N tokens"
            vllm["max_concurrency"] = round(stage.blocks / blocks_per_request, 2)
        plans["vllm"] = vllm
    if dtype.name in SGLANG_KV_DTYPES:
        args = ["python", "-m", "sglang.launch_server", "--model-path", model, "--tp", str(dev.tp)]
        if dev.pp > 1:
            args += ["--pp-size", str(dev.pp)]
        args += ["--mem-fraction-static", f"{dev.utilization:g}", "--context-length", str(context)]
        if SGLANG_KV_DTYPES[dtype.name]:
            args += ["--kv-cache-dtype", SGLANG_KV_DTYPES[dtype.name]]
        sglang: dict[str, Any] = {"args": args}
        # ModelRunner.profile_max_num_token: (memory x mem_fraction_static - weights) // cell_size;
        # SGLang keeps activations outside the static fraction, so no overhead is subtracted.
        if not shape.sliding and stage.kv_bytes_per_token:
            rest = max(0, int(dev.memory * dev.utilization) - stage.weight_bytes)
            sglang["max_total_num_tokens"] = rest // stage.kv_bytes_per_token
        plans["sglang"] = sglang
    if dtype.name in LLAMA_CPP_KV_DTYPES and stage.max_batch:
        # llama.cpp's server shares one cache of -c tokens among -np slots, context / slot each.
        batch = stage.max_batch
        args = ["llama-server", "-m", gguf, "-c", str(batch * context), "-np", str(batch), "-ngl", "999"]
        if LLAMA_CPP_KV_DTYPES[dtype.name]:
            args += ["-ctk", LLAMA_CPP_KV_DTYPES[dtype.name], "-ctv", LLAMA_CPP_KV_DTYPES[dtype.name]]
        plans["llama.cpp"] = {"args": args}
    return plans
