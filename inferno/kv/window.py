"""`--kv window`: each sliding layer keeps its first `sinks` positions and a ring buffer of the last
`window` positions (StreamingLLM), so generation runs past the model's context in constant memory.

A sliding layer with window W and S sinks holds S + W rows: position t < S goes to slot t, every
later position to slot S + (t - S) % W, overwriting the position W before it. A query at t attends to
the sinks and to positions t - W + 1 .. t. Global layers (window None, in a model mixing both) hold
every position up to the capacity, as `prealloc` does, and refuse past it. With global layers the
capacity is what the request needs (its prompt and new tokens) and may be less than S + W: a sliding
layer then holds only `capacity` slots, never wraps and refuses past it as the global ones do, so a
short request allocates what it keeps (an 8-token Gemma 3 request: 8 rows a layer, not 516 and 32,768).

Rows are stored in an element type (`--kv-dtype`, `inferno.kv.dtypes`) that keeps each position's row
on its own: f32, f16, q8_0, q8_0h, q4_0, q4_0h. A slot holds a row encoded as it is written; decode
attention runs on the stored slot rows directly (softmax does not care about their order), and
readers and prefill's attention over older rows get them decoded. q4_kivi and q4_recent store
positions in groups (channel groups of 64, segment means, a q8_0 ring of their own), which a ring
overwriting one position at a time cannot hold: they are refused.

Keys are stored after RoPE. When the window has slid, the query at t is far from the sinks; how far
is `positions`:

- "shift" (StreamingLLM's positions within the cache, llama.cpp's context shift): the cache is read
  as if its rows were contiguous, the query at cache position S + W - 1. Window rows are already at
  their true distance from the query, so only the S sink keys move: each decode step re-rotates them
  (from a float32 copy at their original rotation, `sink_keys`) by delta = t - (S + W - 1) and encodes
  them again into their slots. No distance ever exceeds S + W - 1, so the model never sees a relative
  position it was not trained on.
- "original" (mlx-lm's RotatingKVCache): every key keeps its own position; the sinks drift ever
  further from the query, past the trained context once t is.

Until a layer has evicted anything (at most S + W positions), both are exactly `prealloc` without the
window (every position up to S + W is seen).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inferno.errors import InfernoError
from inferno.kernels import attention, ops
from inferno.kv.base import KVCache
from inferno.kv.dtypes import DTYPES, F32, ElementType
from inferno.kv.geometry import KVGeometry
from inferno.kv.memory import lazy_zeros

ITEMSIZE = np.dtype(np.float32).itemsize  # of the sinks' float32 copies
DEFAULT_SINKS = 4  # StreamingLLM's
POSITIONS = ("shift", "original")
DEFAULT_POSITIONS = "shift"


class WindowKVCache(KVCache):
    """Sinks plus a ring buffer of the last `window` positions per sliding layer; evicts, never refuses."""

    kind = "window"
    evicts = True
    # the row element types: each position's row stored on its own, so a slot can be overwritten
    dtypes = tuple(name for name, t in DTYPES.items() if type(t) is ElementType)

    def __init__(
        self,
        geometry: KVGeometry,
        capacity: int,
        window: int | None = None,
        sinks: int = DEFAULT_SINKS,
        positions: str = DEFAULT_POSITIONS,
        rotary: Sequence[ops.Rotary] | None = None,  # per layer: the model's RoPE
        dtype: str = F32,
    ):
        geometry = self.geometry_for(geometry, capacity, window, sinks, positions)
        super().__init__(geometry, capacity, dtype)
        if positions == "shift" and rotary is None:
            raise ValueError("the shift positions need the model's RoPE (rotary)")
        self.sinks, self.positions, self.rotary = sinks, positions, rotary
        self.rows = self.layer_rows(geometry, capacity, sinks)  # slots of each layer
        self.wraps = self.layer_wraps(geometry, self.rows, sinks)  # layers whose ring overwrites
        if None not in geometry.windows:
            self.capacity = max(self.rows)  # what it holds at most: `capacity` only bounded the window
        items, storage = self.dtype.row_items(geometry), self.dtype.storage
        self.keys = [lazy_zeros((n, items), storage) for n in self.rows]
        self.values = [lazy_zeros((n, items), storage) for n in self.rows]
        # shift: the sinks' keys at their own rotation, in float32; the slots hold them moved to the
        # query's frame (and encoded) once the window slid
        self.sink_keys = [
            lazy_zeros((sinks, geometry.kv_width)) if self._shifts(layer) else None
            for layer in range(geometry.layers)
        ]
        self._moved = [0] * geometry.layers  # positions the sink slots' keys are rotated by

    @classmethod
    def element_type(cls, dtype: str) -> ElementType:
        if dtype in DTYPES and dtype not in cls.dtypes:
            raise InfernoError(
                f"a window cache holds {', '.join(cls.dtypes)} rows, not {dtype}: {dtype} stores positions "
                "in groups, which a ring overwriting one position at a time cannot hold (prealloc and paged "
                "hold it)"
            )
        return super().element_type(dtype)

    @staticmethod
    def geometry_for(
        geometry: KVGeometry, capacity: int, window: int | None, sinks: int, positions: str
    ) -> KVGeometry:
        """The geometry with its windows (`window` for every layer of a model without its own),
        refusing settings that cannot make a window cache of `capacity` tokens."""
        if window is not None:
            if window < 1:
                raise InfernoError(f"a window must hold at least 1 position, got {window}")
            geometry = geometry.with_window(window)
        if not geometry.sliding:
            raise InfernoError("a window cache needs a window: the model sets none, give one (--window W)")
        if positions not in POSITIONS:
            raise InfernoError(f"unknown window positions {positions!r} (valid: {', '.join(POSITIONS)})")
        if sinks < 0:
            raise InfernoError(f"sinks must be 0 or more, got {sinks}")
        all_sliding = None not in geometry.windows
        for w in {w for w in geometry.windows if w is not None}:
            if sinks >= w:
                raise InfernoError(f"{sinks} sinks must be fewer than the window of {w}")
            # with global layers the capacity is the request's: sliding layers then hold no more than it
            if all_sliding and sinks + w > capacity:
                raise InfernoError(
                    f"a window of {w} + {sinks} sinks is more than the cache's {capacity} tokens"
                )
        return geometry

    @staticmethod
    def layer_rows(geometry: KVGeometry, capacity: int, sinks: int) -> list[int]:
        windows = (geometry.window(layer) for layer in range(geometry.layers))
        return [capacity if w is None else min(sinks + w, capacity) for w in windows]

    @staticmethod
    def layer_wraps(geometry: KVGeometry, rows: Sequence[int], sinks: int) -> list[bool]:
        """Per layer: whether its slots are a ring that evicts (a sliding layer holding sinks + window)."""
        windows = (geometry.window(layer) for layer in range(geometry.layers))
        return [w is not None and n == sinks + w for w, n in zip(windows, rows, strict=True)]

    @classmethod
    def planned_nbytes(
        cls,
        geometry: KVGeometry,
        capacity: int,
        window: int | None = None,
        sinks: int = DEFAULT_SINKS,
        positions: str = DEFAULT_POSITIONS,
        dtype: str = F32,
        rotary: Sequence[ops.Rotary] | None = None,  # make_cache's options as they are: sizes nothing
    ) -> int:
        element = cls.element_type(dtype)
        geometry = cls.geometry_for(geometry, capacity, window, sinks, positions)
        rows = cls.layer_rows(geometry, capacity, sinks)
        element.row_items(geometry)  # refuses a geometry the element type cannot store
        shifting = sum(cls.layer_wraps(geometry, rows, sinks)) if positions == "shift" and sinks else 0
        return 2 * sum(rows) * element.row_bytes(geometry) + shifting * sinks * geometry.kv_width * ITEMSIZE

    @property
    def nbytes(self) -> int:
        held = self.keys + self.values + [k for k in self.sink_keys if k is not None]
        return sum(a.nbytes for a in held)

    # -- where each position lives ---------------------------------------------------------------

    def _shifts(self, layer: int) -> bool:
        return self.positions == "shift" and self.sinks > 0 and self.wraps[layer]

    def _slots(self, layer: int, positions: np.ndarray) -> np.ndarray:
        w, s = self.geometry.window(layer), self.sinks
        if w is None:
            return positions
        return np.where(positions < s, positions, s + (positions - s) % w)

    def held_positions(self, layer: int, end: int | None = None) -> np.ndarray:
        """The positions `layer` holds when `end` positions went through it (default: all it was written):
        its sinks, then its window, ascending."""
        end = self._written[layer] if end is None else end
        w, s = self.geometry.window(layer), self.sinks
        if w is None or end <= s + w:
            return np.arange(end)
        return np.concatenate([np.arange(s), np.arange(end - w, end)])

    def evicted(self, layer: int, end: int | None = None) -> int:
        """Positions `layer` dropped once `end` positions went through it."""
        end = self._written[layer] if end is None else end
        return end - len(self.held_positions(layer, end))

    @property
    def evicted_tokens(self) -> int:
        return max(self.evicted(layer, self.length) for layer in range(self.n_layers))

    # -- the element type ------------------------------------------------------------------------

    def _encode(self, rows: np.ndarray) -> np.ndarray:
        return self.dtype.encode(rows, self.geometry)

    def _decode(self, stored: np.ndarray) -> np.ndarray:
        return self.dtype.decode(stored, self.geometry)

    def _round(self, rows: np.ndarray) -> np.ndarray:
        """float32 rows as the element type gives them back (f32: the rows themselves)."""
        return rows if self.dtype.fmt is None else self._decode(self._encode(rows))

    # -- the protocol ----------------------------------------------------------------------------

    def _check_room(self, layer: int, pos: int, n: int) -> None:
        if not self.wraps[layer]:
            super()._check_room(layer, pos, n)  # a global layer keeps every position, as does a short one

    def _store(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self._put(layer, pos, k, v, stored=False)

    def _store_stored(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        self._put(layer, pos, k, v, stored=True)

    def _put(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray, stored: bool) -> None:
        """Rows k, v at pos..: float32 rows, or already `stored` in the element type."""
        end = pos + k.shape[0]
        at = np.arange(pos, end)
        keep = np.isin(at, self.held_positions(layer, end))  # rows a longer write would overwrite go now
        slots = self._slots(layer, at[keep])
        kept_k, kept_v = k[keep], v[keep]
        if not stored:
            kept_k, kept_v = self._encode(kept_k), self._encode(kept_v)
        self.keys[layer][slots] = kept_k
        self.values[layer][slots] = kept_v
        if self._shifts(layer):
            sinks = at < self.sinks
            if sinks.any():
                self.sink_keys[layer][at[sinks]] = self._decode(k[sinks]) if stored else k[sinks]
                self._moved[layer] = 0  # the sink slots hold them unmoved

    def _stored(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Stored rows of positions 0 .. end - 1, in order: only while the layer still holds all of them."""
        if end > self.sinks and self.evicted(layer):
            held = self._describe(layer)
            raise InfernoError(f"layer {layer} no longer holds positions 0..{end - 1}: it holds {held}")
        keys = self.keys[layer][:end]
        if self._moved[layer]:  # the sink slots hold moved keys: the originals, as stored
            keys = self._encode(self.sink_keys[layer][:end])
        return keys, self.values[layer][:end]

    def _rows(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        keys, values = self._stored(layer, end)
        return self._decode(keys), self._decode(values)

    def stored_rows(self, layer: int, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        end = self.length if end is None else end
        if end > self._written[layer]:
            raise ValueError(f"layer {layer} holds {self._written[layer]} rows, {end} asked for")
        return self._stored(layer, end)

    def _clear(self) -> None:
        # what a layer holds is decided by how many positions it was written; stale slots are never read
        self._moved = [0] * self.n_layers

    def _describe(self, layer: int, end: int | None = None) -> str:
        held = self.held_positions(layer, end)
        if len(held) == 0:
            return "nothing"
        if len(held) == held[-1] + 1:
            return f"positions 0..{held[-1]}"
        return f"sinks 0..{self.sinks - 1} and positions {held[self.sinks]}..{held[-1]}"

    def head_rows(self, layer: int, head: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of one KV head at committed positions start .. end - 1, which must all still be held."""
        g = self.geometry
        if not (0 <= layer < g.layers and 0 <= head < g.kv_heads and 0 <= start <= end <= self.length):
            return super().head_rows(layer, head, start, end)  # raises its bounds error
        wanted = np.arange(start, end)
        gone = wanted[~np.isin(wanted, self.held_positions(layer, self.length))]
        if len(gone):
            raise IndexError(
                f"positions {gone[0]}..{gone[-1]} of layer {layer} were evicted: "
                f"it holds {self._describe(layer, self.length)}"
            )
        keys, values = self._gather(layer, wanted)
        cols = slice(head * g.head_dim, (head + 1) * g.head_dim)
        return keys[:, cols], values[:, cols]

    def held_rows(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions, keys, values) of every committed position `layer` still holds, ascending; keys
        at their own rotation."""
        positions = self.held_positions(layer, self.length)
        return (positions, *self._gather(layer, positions))

    def attended_keys(self, layer: int) -> np.ndarray:
        """Keys of the held positions, ascending, as the query at the last committed position saw them
        (shift: the sinks moved by the slide)."""
        _, keys, _ = self.held_rows(layer)
        w = self.geometry.window(layer)
        if self._shifts(layer) and self.length > self.sinks + w:
            self.rotary[layer].rotate(keys[: self.sinks], self.geometry.kv_heads,
                               np.full(self.sinks, self.length - self.sinks - w))
        return keys

    def _gather(self, layer: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Keys (at their own rotation) and values of held positions: float32, as the element type keeps
        them."""
        slots = self._slots(layer, positions)
        keys = self._decode(self.keys[layer][slots])
        if self._moved[layer]:
            sinks = positions < self.sinks
            keys[sinks] = self._round(self.sink_keys[layer][positions[sinks]])
        return keys, self._decode(self.values[layer][slots])

    def attend(self, layer: int, query: np.ndarray, end: int) -> np.ndarray:
        """The query at end - 1 over what the layer holds, on the stored rows (slot order: softmax does
        not care)."""
        w, written = self.geometry.window(layer), self._written[layer]
        if end > written or (w is not None and end != written):
            raise ValueError(f"layer {layer} was written {written} positions, {end} asked for")
        held = end if w is None else min(end, self.sinks + w)
        delta = 0 if w is None else end - (self.sinks + w)
        if self._shifts(layer) and delta > 0 and self._moved[layer] != delta:
            moved = self.sink_keys[layer].copy()
            self.rotary[layer].rotate(moved, self.geometry.kv_heads, np.full(self.sinks, delta))
            self.keys[layer][: self.sinks] = self._encode(moved)
            self._moved[layer] = delta
        keys, values = self.keys[layer][:held], self.values[layer][:held]
        return self.dtype.attend(query, keys, values, self.geometry)

    def attend_new(self, layer: int, pos: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Prefill's attention: each query over the sinks and the last `window` positions up to itself."""
        w, s, n = self.geometry.window(layer), self.sinks, q.shape[0]
        if w is None or pos + n <= s + w:  # every query sees every position up to itself: prealloc's
            self.write(layer, pos, k, v)
            keys, values = self.read(layer, pos + n)
            return attention.attention_prefill(q, keys, values, self.geometry.heads, pos)
        held = self.held_positions(layer)
        old_keys, old_values = self._gather(layer, held)
        keys = np.concatenate([old_keys, self._round(k)])
        values = np.concatenate([old_values, self._round(v)])
        key_pos = np.concatenate([held, np.arange(pos, pos + n)])
        q_sinks = None
        if self._shifts(layer):  # scoring the sinks, each query moves back to its cache position s + w - 1
            q_sinks = q.copy()
            back = np.maximum(0, np.arange(pos, pos + n) - (s + w - 1))
            self.rotary[layer].rotate(q_sinks, self.geometry.heads, -back)
        out = attention.attention_window(q, keys, values, key_pos, pos, self.geometry.heads, w, s, q_sinks)
        self.write(layer, pos, k, v)
        return out
