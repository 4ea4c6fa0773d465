"""GGML block types as plain ints, which Numba freezes as constants (an IntEnum member would not be)."""

from gguf import GGMLQuantizationType as QType

F32, F16, BF16 = int(QType.F32), int(QType.F16), int(QType.BF16)
Q8_0, Q4_0, Q4_1 = int(QType.Q8_0), int(QType.Q4_0), int(QType.Q4_1)
Q5_0, Q5_1 = int(QType.Q5_0), int(QType.Q5_1)
Q4_K, Q5_K, Q6_K = int(QType.Q4_K), int(QType.Q5_K), int(QType.Q6_K)
