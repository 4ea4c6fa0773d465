"""The kernels: every loop the CPU runs per token, compiled by Numba for the host's full vector width.

The contract, for every kernel here and in inferno.kv's stored-block kernels: float32 (or the weights'
GGUF blocks), C-contiguous arrays, one signature each, so each compiles once and is cached on disk;
no checks of shapes or indices inside (inferno.model.validate checks the file before any kernel runs);
parallel only where a call has enough work to wake a thread pool.

- jit: the target every kernel compiles for (`njit`); imported first, below, so that it is set before
  any kernel or intrinsic is defined.
- llvm_ir: the hand-written LLVM IR, gathered: its builders and the intrinsics (prefetch, bit casts).
- ops: RMSNorm, RoPE, softmax, the MLP's gating.
- attention: decode's parallel spans, prefill's blocks through BLAS, a sliding window.
- quant: weights kept in their GGUF block types; matvec on the blocks, BLAS on dequantized chunks.
- nibble_dots: integer dots of the 4-, 5- and 6-bit types (and Q8_0) on AVX512-VNNI.
- activation_parts: activations split into int8 parts, float32's precision in four, for those dots.
- quant_batch: a few activation rows against a quantized weight, the weight read once for all.
"""

from inferno.kernels import jit  # noqa: F401  (first: the target is set before any kernel is defined)
