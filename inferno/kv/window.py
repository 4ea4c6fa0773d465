"""`--kv window`: each sliding layer keeps its first `sinks` positions and a ring buffer of the last
`window` positions (StreamingLLM), so generation runs past the model's context in constant memory.

A sliding layer with window W and S sinks holds S + W rows: position t < S goes to slot t, every
later position to slot S + (t - S) % W, overwriting the position W before it. A query at t attends to
the sinks and to positions t - W + 1 .. t. Global layers (window None, in a model mixing both) hold
every position up to the capacity, as `prealloc` does, and refuse past it. With global layers the
capacity is what the request needs (its prompt and new tokens) and may be less than S + W: a sliding
layer then holds only `capacity` slots, never wraps and refuses past it as the global ones do, so a
short request allocates what it keeps (an 8-token Gemma 3 request: 8 rows a layer, not 516 and 32,768).

Rows are stored in any element type (`--kv-dtype`, `inferno.kv.dtypes`). A row type (f32, f16, q8_0,
q8_0h, q4_0, q4_0h) keeps each position's row on its own: a slot holds a row encoded as it is written;
decode attention runs on the stored slot rows directly (softmax does not care about their order), and
readers and prefill's attention over older rows get them decoded.

q4_kivi and q4_recent round positions together (key groups of 64; segments of 128 sharing a key mean),
so a sliding layer keeps whole groups: a ring of blocks of 64 (128) positions (`kivi.KiviRing`,
`recent.RecentRing`), which their own kernels read through the table of a ring, as prealloc's rows and
paged's blocks are read. The state runs on past any capacity (q4_kivi closes every group; q4_recent
writes every row into the body, its key means a ring too), and the ring holds every position until the
window slides, so attention is prealloc's until then. The sinks are kept apart from the ring in the
form the newest rows have (q4_kivi f16, q4_recent q8_0): once the window slid, the kernels read them as
one more span. Prefill over a sliding ring goes in pieces that end at a block's end at the latest, each
written and then attended over what it may see (the ring holds a block more than the window for that).

Keys are stored after RoPE. When the window has slid, the query at t is far from the sinks; how far
is `positions`:

- "shift" (StreamingLLM's positions within the cache, llama.cpp's context shift): the cache is read
  as if its rows were contiguous, the query at cache position S + W - 1. Window rows are already at
  their true distance from the query, so only the S sink keys move: each decode step re-rotates them
  (from a float32 copy at their original rotation, `sink_keys`) by delta = t - (S + W - 1) and encodes
  them again into their slots. q4_kivi and q4_recent, whose sinks cannot be rounded again on their own,
  move the query instead, back by delta for the sinks' scores only (as prefill does for every type):
  RoPE's scores depend on the distance alone. No distance ever exceeds S + W - 1, so the model never
  sees a relative position it was not trained on.
- "original" (mlx-lm's RotatingKVCache): every key keeps its own position; the sinks drift ever
  further from the query, past the trained context once t is.

Until a layer has evicted anything (at most S + W positions), both are exactly `prealloc` without the
window (every position up to S + W is seen).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from inferno.errors import InfernoError
from inferno.kernels import attention, ops
from inferno.kv import kivi, recent
from inferno.kv.base import KVCache
from inferno.kv.dtypes import DTYPES, F32, ElementType, KiviType, RecentType
from inferno.kv.geometry import KVGeometry
from inferno.kv.memory import lazy_zeros

ITEMSIZE = np.dtype(np.float32).itemsize  # of the sinks' float32 copies
DEFAULT_SINKS = 4  # StreamingLLM's
POSITIONS = ("shift", "original")
DEFAULT_POSITIONS = "shift"


class WindowKVCache(KVCache):
    """Sinks plus a ring buffer of the last `window` positions per sliding layer; evicts, never refuses."""

    layout = "window"
    evicts = True
    dtypes = tuple(DTYPES)  # row types in slots; q4_kivi and q4_recent in rings of blocks

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
        self._moved = [0] * geometry.layers  # positions the sink slots' keys are rotated by
        # q4_kivi, q4_recent: each layer's store (a ring of blocks, or prealloc's for a layer that keeps
        # every position); the row types' slots and sinks' keys stay empty
        self.stores = self.grouped_stores(self.dtype, geometry, self.rows, self.wraps, sinks)
        grouped = self.stores is not None
        items, storage = self.dtype.row_items(geometry), self.dtype.storage
        self.keys = [] if grouped else [lazy_zeros((n, items), storage) for n in self.rows]
        self.values = [] if grouped else [lazy_zeros((n, items), storage) for n in self.rows]
        # shift: the sinks' keys at their own rotation, in float32; the slots hold them moved to the
        # query's frame (and encoded) once the window slid
        self.sink_keys = [
            lazy_zeros((sinks, geometry.kv_width)) if self._shifts(layer) and not grouped else None
            for layer in range(geometry.layers)
        ]

    @staticmethod
    def grouped_stores(dtype: ElementType, geometry: KVGeometry, rows: Sequence[int], wraps: Sequence[bool],
                       sinks: int) -> list[kivi.KiviStore | recent.RecentStore] | None:
        """Per layer, the store of a type that rounds positions together (None for a row type): a ring
        where the layer slides, prealloc's store of its rows where it keeps every position."""
        if not isinstance(dtype, KiviType | RecentType):
            return None
        one = replace(geometry, layers=1, windows=())  # a store per layer: rings differ in their windows
        ring = kivi.KiviRing if isinstance(dtype, KiviType) else recent.RecentRing
        return [ring(one, geometry.window(layer), sinks) if wraps[layer]
                else dtype.make_store(one, rows[layer]) for layer in range(geometry.layers)]

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
        wraps = cls.layer_wraps(geometry, rows, sinks)
        element.row_items(geometry)  # refuses a geometry the element type cannot store
        if isinstance(element, KiviType | RecentType):
            one = replace(geometry, layers=1, windows=())
            ring = kivi.ring_nbytes if isinstance(element, KiviType) else recent.ring_nbytes
            return sum(ring(one, geometry.window(layer), sinks) if wraps[layer]
                       else element.nbytes(one, rows[layer]) for layer in range(geometry.layers))
        shifting = sum(wraps) if positions == "shift" and sinks else 0
        return 2 * sum(rows) * element.row_bytes(geometry) + shifting * sinks * geometry.kv_width * ITEMSIZE

    @property
    def nbytes(self) -> int:
        if self.stores is not None:
            return sum(store.nbytes for store in self.stores)
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
        """Rows k, v at pos..: float32 rows, or already `stored` in the element type (q4_kivi and
        q4_recent: float32 either way, rounded by their store; its ring overwrites what slid out)."""
        if self.stores is not None:
            self.stores[layer].write(0, pos, k, v)
            return
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
        if self.stores is not None:  # float32 rows: what q4_kivi and q4_recent hand out (snapshots)
            return self._gather(layer, np.arange(end))
        keys = self.keys[layer][:end]
        if self._moved[layer]:  # the sink slots hold moved keys: the originals, as stored
            keys = self._encode(self.sink_keys[layer][:end])
        return keys, self.values[layer][:end]

    def _rows(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        keys, values = self._stored(layer, end)
        if self.stores is not None:
            return keys, values
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
        """Keys (at their own rotation) and values of held positions (ascending): float32, as the element
        type keeps them."""
        if self.stores is not None:
            return self._gather_grouped(layer, positions)
        slots = self._slots(layer, positions)
        keys = self._decode(self.keys[layer][slots])
        if self._moved[layer]:
            sinks = positions < self.sinks
            keys[sinks] = self._round(self.sink_keys[layer][positions[sinks]])
        return keys, self._decode(self.values[layer][slots])

    def _gather_grouped(self, layer: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """_gather of q4_kivi and q4_recent: a run of positions from the store as attention reads them
        now, and once the window slid, the sinks from their own copies."""
        store, written, w = self.stores[layer], self._written[layer], self.geometry.kv_width
        keys, values = (np.empty((len(positions), w), np.float32) for _ in range(2))
        sinks = positions < self.sinks if self.wraps[layer] and self.evicted(layer) else positions < 0
        if sinks.any():
            sink_keys, sink_values = store.sink_rows(0)
            keys[sinks], values[sinks] = sink_keys[positions[sinks]], sink_values[positions[sinks]]
        rest = positions[~sinks]
        if len(rest):
            run_keys, run_values = store.read(0, int(rest[-1]) + 1, int(rest[0]), written)
            keys[~sinks], values[~sinks] = run_keys[rest - rest[0]], run_values[rest - rest[0]]
        return keys, values

    def _sink_queries(self, layer: int, q: np.ndarray, first: int) -> np.ndarray | None:
        """shift: queries q [T, heads * head_dim] at positions first.. moved back by the slide, for the
        sinks' scores (the sinks' keys moved forward, as far); None when nothing moves."""
        if not self._shifts(layer):
            return None
        w, s = self.geometry.window(layer), self.sinks
        q_sinks = q.copy()
        back = np.maximum(0, np.arange(first, first + q.shape[0]) - (s + w - 1))
        self.rotary[layer].rotate(q_sinks, self.geometry.heads, -back)
        return q_sinks

    def attend(self, layer: int, query: np.ndarray, end: int) -> np.ndarray:
        """The query at end - 1 over what the layer holds, on the stored rows (slot order: softmax does
        not care)."""
        w, written = self.geometry.window(layer), self._written[layer]
        if end > written or (w is not None and end != written):
            raise ValueError(f"layer {layer} was written {written} positions, {end} asked for")
        if self.stores is not None:
            store = self.stores[layer]
            if w is None or end <= self.sinks + w:  # nothing slid out: prealloc's attention
                return store.attend(0, query, end)
            q_sinks = self._sink_queries(layer, query[None], end - 1)
            return store.attend(0, query, end, end - w, None if q_sinks is None else q_sinks[0])
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
        if self.stores is not None:
            return self._attend_new_grouped(layer, pos, q, k, v)
        held = self.held_positions(layer)
        old_keys, old_values = self._gather(layer, held)
        keys = np.concatenate([old_keys, self._round(k)])
        values = np.concatenate([old_values, self._round(v)])
        key_pos = np.concatenate([held, np.arange(pos, pos + n)])
        # scoring the sinks, each query moves back to its cache position s + w - 1
        q_sinks = self._sink_queries(layer, q, pos)
        out = attention.attention_window(q, keys, values, key_pos, pos, self.geometry.heads, w, s, q_sinks)
        self.write(layer, pos, k, v)
        return out

    def _attend_new_grouped(self, layer: int, pos: int, q: np.ndarray, k: np.ndarray, v: np.ndarray
                            ) -> np.ndarray:
        """Prefill over a sliding ring of q4_kivi or q4_recent: pieces that end at a block's end at the
        latest, each written (its rows rounded as the type rounds them: a group closed, a segment's mean
        taken) and then attended over what its queries may see, which the ring still holds."""
        self._check_write(layer, pos, q.shape[0])  # a layer that keeps every position refuses past it
        store, w, s = self.stores[layer], self.geometry.window(layer), self.sinks
        out = np.empty_like(q)
        a, end = pos, pos + q.shape[0]
        while a < end:
            b = min(end, (a // store.block + 1) * store.block)
            piece = slice(a - pos, b - pos)
            self.write(layer, a, k[piece], v[piece])
            first = max(a + 1 - w, s)  # the oldest position past the sinks a query of the piece sees
            if first == s:  # every position up to b: the sinks as the ring holds them
                key_pos = np.arange(b)
                keys, values = store.read(0, b, 0, b)
            else:
                key_pos = np.concatenate([np.arange(s), np.arange(first, b)])
                keys, values = self._gather_grouped(layer, key_pos)
            q_sinks = self._sink_queries(layer, q[piece], a)
            out[piece] = attention.attention_window(q[piece], keys, values, key_pos, a, self.geometry.heads,
                                                    w, s, q_sinks)
            a = b
        return out
