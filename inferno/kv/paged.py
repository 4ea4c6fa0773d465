"""`--kv paged`: K and V in a pool of fixed-size blocks that many sequences share (vLLM's PagedAttention).

A `BlockPool` holds K and V as [layers, blocks, block_size, kv_width]; each sequence (`PagedKVCache`)
owns a block table, the pool's blocks holding its positions in order, and gets a new block only when
its last one is full. Blocks carry reference counts, so sequences forked from one prompt hold its
blocks once; the first write into a shared block that is not full copies it first (copy-on-write).

Full blocks can be published under a hash of their tokens chained to their parent's (vLLM's automatic
prefix caching): a later prompt starting with the same tokens adopts those blocks instead of
prefilling them. A block no sequence holds keeps its contents and hash until the pool needs it back.

Decode attention reads the blocks where they are, through the block table (`paged_attention`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
from numba import prange

from inferno.errors import InfernoError
from inferno.jit import njit
from inferno.kernels import DECODE_SPAN, combine_spans, softmax_span
from inferno.kv.base import KVCache, KVCacheFullError
from inferno.kv.dtypes import F32
from inferno.kv.geometry import KVGeometry
from inferno.kv.prealloc import lazy_zeros

ITEMSIZE = np.dtype(np.float32).itemsize
BLOCK_SIZE = 16  # tokens per block: vLLM's default


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks holding `tokens` positions."""
    return -(-tokens // block_size)


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The identity of a full block: its tokens and, through the parent's hash, every token before."""
    return hash((parent, tuple(tokens)))


class BlockPool:
    """The blocks sequences share: storage, reference counts, the free list and the prefix index."""

    def __init__(self, geometry: KVGeometry, n_blocks: int, block_size: int = BLOCK_SIZE):
        if block_size < 1:
            raise InfernoError(f"a block holds at least one token, got a block size of {block_size}")
        if n_blocks < 1:
            raise InfernoError(f"a block pool needs at least one block, got {n_blocks}")
        if geometry.sliding:
            raise InfernoError("the paged cache attends over every position: it does not keep a model's "
                               "sliding windows (use --kv prealloc or window)")
        self.geometry = geometry
        self.block_size = block_size
        self.n_blocks = n_blocks
        shape = (geometry.layers, n_blocks, block_size, geometry.kv_width)
        self.keys = lazy_zeros(shape)  # pages become resident as blocks are first written
        self.values = lazy_zeros(shape)
        self.refs = np.zeros(n_blocks, np.int32)
        self._free = list(range(n_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self._idle: OrderedDict[int, int] = OrderedDict()  # unheld published blocks, oldest first -> hash
        self._by_hash: dict[int, int] = {}  # published block hash -> block
        self._hash_of: dict[int, int] = {}

    @classmethod
    def for_tokens(cls, geometry: KVGeometry, tokens: int, block_size: int = BLOCK_SIZE) -> BlockPool:
        return cls(geometry, blocks_for(tokens, block_size), block_size)

    @property
    def block_nbytes(self) -> int:
        """K and V bytes of one block, all layers."""
        return self.geometry.nbytes(self.block_size, ITEMSIZE)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (what it can hold)."""
        return self.n_blocks * self.block_nbytes

    @property
    def used_blocks(self) -> int:
        return int(np.count_nonzero(self.refs))

    @property
    def used_nbytes(self) -> int:
        """Bytes of the blocks some sequence holds: a block shared by N sequences counts once."""
        return self.used_blocks * self.block_nbytes

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take: never written, or idle published ones (evicted oldest first)."""
        return len(self._free) + len(self._idle)

    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._idle:
            block, digest = self._idle.popitem(last=False)
            del self._by_hash[digest], self._hash_of[block]
        else:
            raise KVCacheFullError(f"the KV block pool is full: all {self.n_blocks} blocks are held")
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            del self._idle[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._hash_of:
                self._idle[block] = self._hash_of[block]
            else:
                self._free.append(block)

    def copy(self, src: int, dst: int, rows: int) -> None:
        """The first `rows` positions of block src, every layer, into block dst."""
        self.keys[:, dst, :rows] = self.keys[:, src, :rows]
        self.values[:, dst, :rows] = self.values[:, src, :rows]

    def publish(self, block: int, digest: int) -> None:
        """Make a full block findable by its hash (the first block published under a hash keeps it)."""
        if digest not in self._by_hash and block not in self._hash_of:
            self._by_hash[digest] = block
            self._hash_of[block] = digest

    def lookup(self, digest: int) -> int | None:
        return self._by_hash.get(digest)


class PagedKVCache(KVCache):
    """One sequence's view of a block pool: its block table and length. Alone (no pool given) it owns
    a pool sized for its capacity, so `--kv paged` works wherever the other kinds do."""

    kind = "paged"

    def __init__(self, geometry: KVGeometry, capacity: int, block_size: int = BLOCK_SIZE,
                 pool: BlockPool | None = None, dtype: str = F32):
        super().__init__(geometry, capacity, dtype)
        self.pool = pool or BlockPool.for_tokens(geometry, capacity, block_size)
        self.table: list[int] = []  # pool block of positions [i * block_size, (i + 1) * block_size)
        self.table_array = np.zeros(0, np.int32)  # the same, as the attention kernel reads it
        self.published = 0  # leading blocks whose hashes are in the pool's prefix index
        self._last_hash: int | None = None

    @classmethod
    def planned_nbytes(
        cls, geometry: KVGeometry, capacity: int, block_size: int = BLOCK_SIZE, dtype: str = F32
    ) -> int:
        cls.element_type(dtype)
        return geometry.nbytes(blocks_for(capacity, block_size) * block_size, ITEMSIZE)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this sequence holds (shared ones included: see BlockPool.used_nbytes)."""
        return len(self.table) * self.pool.block_nbytes

    # -- sharing -------------------------------------------------------------------------------

    def fork(self, capacity: int | None = None) -> PagedKVCache:
        """A sequence holding the same committed tokens in the same blocks (reference counted)."""
        if any(written != self.length for written in self._written):
            raise ValueError("fork of a sequence with uncommitted rows")
        other = PagedKVCache(self.geometry, capacity or self.capacity, pool=self.pool)
        for block in self.table:
            self.pool.share(block)
        other._adopt(list(self.table), self.length)
        other.published, other._last_hash = self.published, self._last_hash
        return other

    def reuse_prefix(self, token_ids: Sequence[int]) -> int:
        """Adopt the published blocks holding a prefix of token_ids (this sequence must be empty);
        the tokens reused. The last token is always left to prefill: its logits are needed."""
        if self.length or self.table:
            raise ValueError("reuse_prefix needs an empty sequence")
        bs, parent, blocks = self.block_size, None, []
        for i in range((len(token_ids) - 1) // bs):
            digest = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            block = self.pool.lookup(digest)
            if block is None:
                break
            self.pool.share(block)
            blocks.append(block)
            parent = digest
        self._adopt(blocks, len(blocks) * bs)
        self.published, self._last_hash = len(blocks), parent
        return self.length

    def publish(self, token_ids: Sequence[int]) -> None:
        """Index this sequence's full committed blocks by their tokens (token_ids: those it holds)."""
        bs = self.block_size
        for i in range(self.published, self.length // bs):
            self._last_hash = block_hash(self._last_hash, token_ids[i * bs : (i + 1) * bs])
            self.pool.publish(self.table[i], self._last_hash)
        self.published = max(self.published, self.length // bs)

    def _adopt(self, blocks: list[int], length: int) -> None:
        self.table = blocks
        self.table_array = np.array(blocks, np.int32)
        self.length = length
        self._written = [length] * self.n_layers

    # -- the KVCache protocol ------------------------------------------------------------------

    def prepare(self, pos: int, end: int) -> None:
        """Make positions pos .. end - 1 writable: new blocks past the table, a private copy of a
        shared block that pos falls in. Every layer writes the same positions, so only the first does
        work (a copy made then holds the other layers' earlier rows too)."""
        bs, pool = self.block_size, self.pool
        first = pos // bs
        if first < len(self.table) and pool.refs[self.table[first]] > 1:
            private = pool.allocate()
            pool.copy(self.table[first], private, pos - first * bs)
            pool.release(self.table[first])
            self.table[first] = private
            self.table_array[first] = private
        if blocks_for(end, bs) > len(self.table):
            while blocks_for(end, bs) > len(self.table):
                self.table.append(pool.allocate())
            self.table_array = np.array(self.table, np.int32)

    def _store(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        end, bs = pos + k.shape[0], self.block_size
        self.prepare(pos, end)
        p = pos
        while p < end:
            block, offset = self.table[p // bs], p % bs
            n = min(bs - offset, end - p)
            self.pool.keys[layer, block, offset : offset + n] = k[p - pos : p - pos + n]
            self.pool.values[layer, block, offset : offset + n] = v[p - pos : p - pos + n]
            p += n

    def _rows(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """A gathered copy (prefill's attention, snapshots, kv-inspect); decode reads blocks in place."""
        blocks = self.table_array[: blocks_for(end, self.block_size)]
        width = self.kv_width
        keys = self.pool.keys[layer, blocks].reshape(-1, width)[:end]
        return keys, self.pool.values[layer, blocks].reshape(-1, width)[:end]

    def _clear(self) -> None:
        for block in self.table:
            self.pool.release(block)
        self._adopt([], 0)
        self.published, self._last_hash = 0, None

    def attend(self, layer: int, query: np.ndarray, end: int) -> np.ndarray:
        if end > self._written[layer]:
            raise ValueError(f"layer {layer} holds {self._written[layer]} rows, {end} asked for")
        tables = self.table_array[None, : blocks_for(end, self.block_size)]
        pool = self.pool
        return paged_attention(query[None], pool.keys[layer], pool.values[layer], tables,
                               np.array([end], np.int64), self.geometry.heads)[0]


@njit(cache=True, fastmath=True)
def attend_blocks(q: np.ndarray, keys: np.ndarray, values: np.ndarray, table: np.ndarray, s0: int,
                  s1: int, n_heads: int, weights: np.ndarray, out: np.ndarray, stats: np.ndarray) -> None:
    """kernels.attend_span for positions s0 .. s1 - 1 of a sequence whose rows sit in the pool blocks
    its table names: keys, values [blocks, block_size, kv_width] of one layer. Unnormalised softmax
    per head (out, stats), combined across spans by paged_attention."""
    block_size, kv_width = keys.shape[1], keys.shape[2]
    head_dim = q.shape[0] // n_heads
    n_kv = kv_width // head_dim
    group = n_heads // n_kv
    scale = np.float32(1.0 / math.sqrt(head_dim))
    n_pos = s1 - s0
    for s in range(n_pos):
        block, row = table[(s0 + s) // block_size], (s0 + s) % block_size
        for g in range(n_kv):
            kh = keys[block, row, g * head_dim : (g + 1) * head_dim]
            for h in range(g * group, (g + 1) * group):
                qh = q[h * head_dim : (h + 1) * head_dim]
                acc = np.float32(0.0)
                for j in range(head_dim):
                    acc += qh[j] * kh[j]
                weights[h, s] = acc * scale
    softmax_span(weights, n_pos, stats)
    out[:] = 0.0
    for s in range(n_pos):
        block, row = table[(s0 + s) // block_size], (s0 + s) % block_size
        for g in range(n_kv):
            vh = values[block, row, g * head_dim : (g + 1) * head_dim]
            for h in range(g * group, (g + 1) * group):
                w = weights[h, s]
                oh = out[h * head_dim : (h + 1) * head_dim]
                for j in range(head_dim):
                    oh[j] += w * vh[j]


@njit(cache=True, fastmath=True, parallel=True)
def paged_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, tables: np.ndarray,
                    lengths: np.ndarray, n_heads: int) -> np.ndarray:
    """One query per sequence over that sequence's blocks (flash-decoding over block tables).

    q [B, n_heads * head_dim]; keys, values [blocks, block_size, kv_width] of one layer of the pool;
    tables int32 [B, max blocks] (row b: sequence b's blocks); lengths int64 [B] (positions attended).
    Every sequence's positions are cut into spans of DECODE_SPAN; all spans of all sequences run in
    parallel, then each sequence's spans are rescaled to its global maximum and summed.
    """
    n_seq, width = q.shape
    first = np.zeros(n_seq + 1, np.int64)  # sequence b's spans are first[b] .. first[b + 1] - 1
    for b in range(n_seq):
        first[b + 1] = first[b] + (lengths[b] + DECODE_SPAN - 1) // DECODE_SPAN
    owner = np.empty(first[n_seq], np.int64)
    for b in range(n_seq):
        owner[first[b] : first[b + 1]] = b
    partial = np.empty((first[n_seq], width), np.float32)
    stats = np.empty((first[n_seq], n_heads, 2), np.float32)
    for t in prange(first[n_seq]):
        b = owner[t]
        s0 = (t - first[b]) * DECODE_SPAN
        s1 = min(s0 + DECODE_SPAN, lengths[b])
        weights = np.empty((n_heads, s1 - s0), np.float32)
        attend_blocks(q[b], keys, values, tables[b], s0, s1, n_heads, weights, partial[t], stats[t])
    out = np.empty_like(q)
    for b in range(n_seq):
        out[b] = combine_spans(partial[first[b] : first[b + 1]], stats[first[b] : first[b + 1]], n_heads)
    return out
