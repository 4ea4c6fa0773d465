"""The sequences of one forward (a ragged batch): each one's cache, its new tokens' rows and positions,
and attention routed to the kernel that fits each sequence.

Rows of x are the sequences' new tokens one sequence after another; sequence b owns rows
bounds[b] .. bounds[b + 1] - 1, at positions cache.length .. . A sequence with one new token is a
decode step (one query over its cache); several are a prefill chunk (causal attention over the cache
and themselves). Decode steps of paged sequences sharing one pool attend in one kernel call per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from inferno.kernels import attention
from inferno.kv import KVCache
from inferno.kv.batch import CacheBatch, batch_of
from inferno.kv.paged import PagedKVCache


class _Alone(NamedTuple):
    """A sequence that attends on its own, in Python ints: a decode step reads them in every layer."""

    cache: KVCache | None
    first: int  # its first row
    end: int  # its row past the last
    pos: int  # the position of its first new token


class Ragged:
    def __init__(self, caches: Sequence[KVCache | None], counts: Sequence[int]):
        if len(caches) != len(counts) or not caches:
            raise ValueError(f"{len(caches)} caches for {len(counts)} sequences")
        if any(n < 1 for n in counts):
            raise ValueError(f"every sequence brings at least one token, got {list(counts)}")
        if None in caches and len(caches) > 1:
            raise ValueError("only a single sequence runs without a cache")
        self.caches, self.counts = list(caches), list(counts)
        self.bounds = np.cumsum([0, *counts])
        starts = [0 if c is None else c.length for c in caches]
        self.positions = np.concatenate(
            [np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, counts, strict=True)])
        self.last_rows = self.bounds[1:] - 1  # of each sequence's last token: the rows whose logits count
        # decode steps of paged sequences of one pool: (their rows, their batch)
        pools: dict[int, list[int]] = {}
        for b, (cache, n) in enumerate(zip(caches, counts, strict=True)):
            if n == 1 and isinstance(cache, PagedKVCache):
                pools.setdefault(id(cache.pool), []).append(b)
        together = [members for members in pools.values() if len(members) > 1]
        self._batches: list[tuple[np.ndarray, CacheBatch]] = [
            (self.bounds[members], batch_of([self.caches[b] for b in members])) for members in together
        ]
        grouped = {b for members in together for b in members}
        self._alone = [_Alone(caches[b], int(self.bounds[b]), int(self.bounds[b + 1]), starts[b])
                       for b in range(len(caches)) if b not in grouped]

    def __len__(self) -> int:
        return len(self.caches)

    @property
    def n_tokens(self) -> int:
        return int(self.bounds[-1])

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, n_heads: int,
               window: int | None) -> np.ndarray:
        """Store each sequence's rows k, v [N, kv_width] of `layer` in its cache and attend its
        queries q [N, heads * head_dim] causally over it: [N, heads * head_dim]. window: the layer's
        sliding window (used only without a cache: a cache knows its layers' windows)."""
        if not self._alone and len(self._batches) == 1:  # batched decode alone: no rows to gather
            batch = self._batches[0][1]
            batch.write(layer, k, v)
            return batch.attend(layer, q, n_heads)
        if not self._batches and len(self._alone) == 1:  # one sequence: its rows are all the rows
            return self._attend_alone(layer, self._alone[0], q, k, v, n_heads, window)
        out = np.empty_like(q)
        for rows, batch in self._batches:
            batch.write(layer, k[rows], v[rows])
            out[rows] = batch.attend(layer, q[rows], n_heads)
        for alone in self._alone:
            a, e = alone.first, alone.end
            out[a:e] = self._attend_alone(layer, alone, q[a:e], k[a:e], v[a:e], n_heads, window)
        return out

    @staticmethod
    def _attend_alone(layer: int, alone: _Alone, q: np.ndarray, k: np.ndarray, v: np.ndarray, n_heads: int,
                      window: int | None) -> np.ndarray:
        """`attend` for one sequence's rows q, k, v of its new tokens."""
        cache, pos = alone.cache, alone.pos
        if cache is None:
            return attention.attention_prefill(q, k, v, n_heads, 0, window=window)
        if alone.end - alone.first == 1:
            cache.write(layer, pos, k, v)
            return cache.attend(layer, q[0], pos + 1)[None]
        return cache.attend_new(layer, pos, q, k, v)

    def commit(self) -> None:
        """Every sequence's new tokens become visible in its cache, once every layer stored them."""
        for _, batch in self._batches:
            batch.commit()
        for alone in self._alone:
            if alone.cache is not None:
                alone.cache.commit(alone.end - alone.first)
