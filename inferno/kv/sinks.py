"""The attention sinks of a window's ring of grouped rows (q4_kivi's, q4_recent's): kept apart, in the
form the type keeps its newest rows in, because a ring slot is reused once the window slides past it
while the sinks stay visible for good. A mixin before the type's store in a ring class's bases."""

from __future__ import annotations

import numpy as np

from inferno.kv.blocks import decode_rows, encode_rows, hadamard_rows
from inferno.kv.memory import lazy_zeros


class RingSinks:
    """Sinks as `SINK_FMT` rows (`inferno.kv.blocks`), of Hadamard-rotated heads when SINK_ROTATED."""

    SINK_FMT: int
    SINK_ROTATED: bool = False

    def _make_sinks(self, layers: int, sinks: int, row_bytes: int) -> None:
        self.sinks = sinks
        self.sink_keys = lazy_zeros((layers, sinks, row_bytes), np.uint8)
        self.sink_values = lazy_zeros((layers, sinks, row_bytes), np.uint8)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.sink_keys.nbytes + self.sink_values.nbytes

    def write(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        super().write(layer, pos, k, v)
        n = min(self.sinks - pos, k.shape[0])
        if n > 0:  # a sink: its own copy, which outlives its slot in the ring
            for rows, out in ((k, self.sink_keys), (v, self.sink_values)):
                rows = np.array(rows[:n], np.float32)
                if self.SINK_ROTATED:
                    hadamard_rows(rows, self.geometry.head_dim)
                encode_rows(rows, self.SINK_FMT, out[layer, pos : pos + n])

    def sink_rows(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 keys and values of the sinks, as attention reads them once the window slid."""
        keys, values = (np.empty((self.sinks, self.geometry.kv_width), np.float32) for _ in range(2))
        decode_rows(self.sink_keys[layer], self.SINK_FMT, keys)
        decode_rows(self.sink_values[layer], self.SINK_FMT, values)
        if self.SINK_ROTATED:
            hadamard_rows(keys, self.geometry.head_dim)  # its own inverse
            hadamard_rows(values, self.geometry.head_dim)
        return keys, values

    def attend(self, layer: int, query: np.ndarray, end: int, start: int = 0,
               q_sinks: np.ndarray | None = None) -> np.ndarray:
        """Positions start .. end - 1; with start past the sinks (the window slid) the sinks too, scored
        with q_sinks (default: the query)."""
        sinks = None
        if start > self.sinks > 0:
            sinks = (query if q_sinks is None else q_sinks, self.sink_keys[layer], self.sink_values[layer])
        return self.state.attend(layer, query, start, end, *self._rows(layer), sinks)
