"""Cache buffers that cost memory only where rows are written."""

from __future__ import annotations

import math
import mmap

import numpy as np

from inferno.errors import InfernoError


def lazy_zeros(shape: tuple[int, ...], dtype: type[np.generic] = np.float32) -> np.ndarray:
    """Zeros in fresh anonymous memory, made resident page by page (4 KiB) as rows are written.

    np.zeros would do the same, except that numpy asks Linux for transparent huge pages on large
    arrays: the first row written in each layer then makes 2 MiB resident, 120 MiB for a 4096-token
    SmolLM2 cache holding 36 tokens.
    """
    count = math.prod(shape)
    itemsize = np.dtype(dtype).itemsize
    try:
        buffer = mmap.mmap(-1, max(itemsize * count, 1))
    except (OSError, OverflowError) as exc:  # past what the OS maps (ENOMEM), or past a C size
        reason = getattr(exc, "strerror", None) or "too large"
        raise InfernoError(f"cannot reserve {itemsize * count / 2**30:,.1f} GiB for the KV cache: "
                           f"{reason.lower()}") from None
    return np.frombuffer(buffer, dtype, count).reshape(shape)
