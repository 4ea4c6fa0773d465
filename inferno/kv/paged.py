"""`--kv paged`: K and V in a pool of fixed-size blocks that many sequences share (vLLM's PagedAttention).

A `BlockPool` holds K and V rows in any element type (encoded as they are written); each sequence
(`PagedKVCache`) owns block tables, the pool's blocks holding its positions in order, and gets a new
block only when its last one is full. Blocks carry reference counts, so sequences forked from one
prompt hold its blocks once; the first write into a shared block that is not full copies it first
(copy-on-write).

The pool, its layer groups and its prefix index are `inferno.kv.pool`'s. Each layer group has its own
block table per sequence. A sliding group releases a block once no future query can see it (its table
slot becomes a hole, -1), so it holds about window / block_size + 2 blocks. Full blocks are published
under a hash of their tokens chained to their parent's; a later prompt starting with the same tokens
adopts them instead of prefilling them.

Decode attention reads the blocks where they are, through the block table: the one decode-attention
kernel of every layout (`inferno.kv.blocks.attend_tables`).

q4_recent and q4_kivi keep state that spans positions. Their blocks hold what each position has on its
own (q4_recent: the 4-bit body row, keys minus their segment's mean; q4_kivi: a key group's record cut
into one piece per position, and q4_0 values), written by the kernels prealloc uses, addressed through
the tables; the rest lives with the sequence (`state`: q4_recent's q8_0 ring of its newest rows and its
key means; q4_kivi's open group in f16), and their attention kernels read blocks through the same
(table, block_size) addressing as attend_tables. So each produces prealloc's rows and attention bit for
bit. What that means for sharing and sliding groups:
- a block's rows are a function of the tokens before its end, so published blocks stay consistent;
- q4_kivi publishes and adopts whole key groups only (a group is rounded when its last position is
  written: an earlier block holds nothing yet), its block size divides 64 or is a multiple of it (a
  block never holds two groups' unfinished halves), a fork shares the closed groups' blocks and makes its
  open group's anew, and a sliding group releases a key group's blocks together;
- q4_recent neither publishes nor adopts: a sequence adopting a prefix would need the q8_0 rows of the
  prefix's newest RECENT positions, which no block holds (computing them again would not give the same
  rows). A fork copies them, so forks share every block. A segment's key mean is taken from its rows
  when the next segment starts, so a sliding group keeps the open segment's blocks until then.

A scheduler reserves blocks before a forward, never inside it: `PagedKVCache.blocks_needed(end)` is
what `prepare(length, end)` takes from the pool (`BlockPool.free_blocks` is what it can give), and
`prepare` refuses (KVCacheFullError) without changing anything when the pool cannot supply them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inferno.errors import InfernoError
from inferno.kernels import attention
from inferno.kv import kivi, recent
from inferno.kv.base import KVCache, KVCacheFullError
from inferno.kv.blocks import attend_tables
from inferno.kv.dtypes import F32, ElementType
from inferno.kv.geometry import KVGeometry
from inferno.kv.pool import (
    BLOCK_SIZE,
    HOLE,
    PAGED_DTYPES,
    BlockPool,
    block_hash,
    blocks_for,
    group_hash,
    paged_element_type,
    sequence_state,
    state_nbytes,
)


class PagedKVCache(KVCache):
    """One sequence's view of a block pool: a block table per layer group, and its length. Alone (no
    pool given) it owns a pool sized for its capacity, so `--kv paged` works wherever the other layouts
    do. With a pool, its element type is the pool's."""

    layout = "paged"
    dtypes = PAGED_DTYPES

    def __init__(self, geometry: KVGeometry, capacity: int, block_size: int = BLOCK_SIZE,
                 pool: BlockPool | None = None, dtype: str | None = None):
        if pool is not None and dtype is not None and dtype != pool.dtype.name:
            raise InfernoError(f"a paged cache holds its pool's rows: {pool.dtype.name}, not {dtype}")
        dtype = pool.dtype.name if pool is not None else (dtype or F32)
        super().__init__(geometry, capacity, dtype)
        self.pool = pool or BlockPool.for_tokens(geometry, capacity, block_size, dtype)
        self.groups = self.pool.groups
        self.tables: list[list[int]] = [[] for _ in self.groups]  # per group: block of positions
        self.table_arrays = [np.zeros(0, np.int32) for _ in self.groups]  # [i * bs, (i + 1) * bs), as read
        self.published = 0  # leading full blocks whose hashes are in the pool's prefix index
        self._digests: list[int] = []  # token hash of each full block published, chained
        self._memo: dict[tuple[int, int], np.ndarray] = {}  # (group, end) -> attention_range
        # q4_recent / q4_kivi: what the sequence keeps besides its blocks (see the module)
        self.state = sequence_state(self.dtype, geometry, capacity)

    @classmethod
    def element_type(cls, dtype: str) -> ElementType:
        return paged_element_type(dtype)

    @classmethod
    def planned_nbytes(
        cls, geometry: KVGeometry, capacity: int, block_size: int = BLOCK_SIZE, dtype: str = F32
    ) -> int:
        """The bytes of the pool a lone cache of `capacity` allocates (BlockPool.for_tokens), and of its
        sequence's own state (q4_recent, q4_kivi)."""
        blocks = BlockPool.sequence_blocks(geometry, capacity, block_size)
        own = state_nbytes(paged_element_type(dtype), geometry, capacity)
        return blocks * BlockPool.planned_block_nbytes(geometry, block_size, dtype) + own

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    # group 0's table (the global layers' whenever a layer is global): what kv-inspect shows
    @property
    def table(self) -> list[int]:
        return self.tables[0]

    @table.setter
    def table(self, blocks: list[int]) -> None:
        self.tables[0] = list(blocks)

    @property
    def table_array(self) -> np.ndarray:
        return self.table_arrays[0]

    @table_array.setter
    def table_array(self, blocks: np.ndarray) -> None:
        self.table_arrays[0] = np.asarray(blocks, np.int32)

    def held_blocks(self) -> list[int]:
        """Every block this sequence holds, all groups (holes left out)."""
        return [b for table in self.tables for b in table if b != HOLE]

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this sequence holds (shared ones included: see BlockPool.used_nbytes), and
        of its own state."""
        own = 0 if self.state is None else self.state.nbytes
        return len(self.held_blocks()) * self.pool.block_nbytes + own

    # -- sharing -------------------------------------------------------------------------------

    def fork(self, capacity: int | None = None) -> PagedKVCache:
        """A sequence holding the same committed tokens in the same blocks (reference counted), in every
        layer group."""
        if any(written != self.length for written in self._written):
            raise ValueError("fork of a sequence with uncommitted rows")
        other = PagedKVCache(self.geometry, capacity or self.capacity, pool=self.pool)
        tables = [list(t) for t in self.tables]
        if self.state is not None:
            if other.capacity != self.capacity:
                raise InfernoError(f"a {self.dtype.name} sequence forks at its own capacity, {self.capacity}")
            other.state = self.state.copy()
            if isinstance(self.state, kivi.KiviState):  # the open group's blocks are written when it closes
                keep = blocks_for(self._closed_end(self.length), self.block_size)
                tables = [t[:keep] for t in tables]
        for block in (b for t in tables for b in t if b != HOLE):
            self.pool.share(block)
        other._adopt(tables, self.length)
        other.published, other._digests = self.published, list(self._digests)
        return other

    def _closed_end(self, length: int) -> int:
        """The first position past the rows whose blocks are written for good (q4_kivi: the open group
        is rounded into its blocks when it is full; other types: every position written)."""
        if isinstance(self.state, kivi.KiviState):
            return self.state.closed(length) * kivi.GROUP
        return length

    def reuse_prefix(self, token_ids: Sequence[int]) -> int:
        """Adopt the published blocks holding a prefix of token_ids (this sequence must be empty);
        the tokens reused. The last token is always left to prefill: its logits are needed.

        A prefix of n blocks is reused when every group still has in the index the blocks a query past
        it can see: a global group all n, a sliding group those holding the last `window` positions."""
        if self.length or any(self.tables):
            raise ValueError("reuse_prefix needs an empty sequence")
        if not self.shares_prefixes:
            return 0
        bs, pool, parent, digests, found = self.block_size, self.pool, None, [], []
        for i in range((len(token_ids) - 1) // bs):
            parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            found.append([pool.lookup(group_hash(g, parent)) for g in range(len(self.groups))])
            digests.append(parent)
        n = len(found)
        if isinstance(self.state, kivi.KiviState):  # whole key groups: the open group starts empty
            n = self._closed_end(n * bs) // bs
        while n and not all(self._reusable(g, found, n) for g in range(len(self.groups))):
            n -= self._adopt_unit()
        tables: list[list[int]] = []
        for g in range(len(self.groups)):
            first = self._first_needed(g, n * bs)
            table = [HOLE] * first + [found[i][g] for i in range(first, n)]  # type: ignore[misc]
            for block in table[first:]:
                pool.share(block)
            tables.append(table)
        self._adopt(tables, n * bs)
        self.published, self._digests = n, digests[:n]
        return self.length

    def _first_needed(self, g: int, length: int) -> int:
        """The first block of group g a query at position `length` or later can see."""
        window = self.groups[g].window
        if window is None:
            return 0
        first = max(length + 1 - window, 0)
        if isinstance(self.state, kivi.KiviState):  # a visible key group keeps all its blocks
            first -= first % kivi.GROUP
        if isinstance(self.state, recent.RecentState):  # the rows the next segment's mean is taken from
            first = min(first, self.state.first_kept(length))
        return first // self.block_size

    def _adopt_unit(self) -> int:
        """Blocks a reused prefix grows by: one, or a key group's (q4_kivi)."""
        if isinstance(self.state, kivi.KiviState):
            return max(kivi.GROUP // self.block_size, 1)
        return 1

    def _reusable(self, g: int, found: list[list[int | None]], n: int) -> bool:
        return all(found[i][g] is not None for i in range(self._first_needed(g, n * self.block_size), n))

    @property
    def shares_prefixes(self) -> bool:
        """Whether its full blocks are published for later prompts: not q4_recent's (see the module)."""
        return not isinstance(self.state, recent.RecentState)

    def publish(self, token_ids: Sequence[int]) -> None:
        """Index this sequence's full committed blocks by their tokens (token_ids: those it holds); a
        block a sliding group released is not published."""
        bs = self.block_size
        if not self.shares_prefixes:
            return
        for i in range(self.published, self._closed_end(self.length) // bs):
            parent = self._digests[-1] if self._digests else None
            self._digests.append(block_hash(parent, token_ids[i * bs : (i + 1) * bs]))
            for g, table in enumerate(self.tables):
                if table[i] != HOLE:
                    self.pool.publish(table[i], group_hash(g, self._digests[-1]))
        self.published = max(self.published, self._closed_end(self.length) // bs)

    def _adopt(self, tables: list[list[int]], length: int) -> None:
        self.tables = tables
        self.table_arrays = [np.array(t, np.int32) for t in tables]
        self.length = length
        self._written = [length] * self.n_layers

    # -- blocks for a scheduler ------------------------------------------------------------------

    def _needs(self, pos: int, end: int) -> list[tuple[bool, int]]:
        """Per group: whether the block pos falls in is shared and must be copied before a write, and
        how many new blocks positions up to end - 1 take."""
        bs, refs, needs = self.block_size, self.pool.refs, []
        first = pos // bs
        for table in self.tables:
            copy = bool(first < len(table) and table[first] != HOLE and refs[table[first]] > 1)
            needs.append((copy, max(blocks_for(end, bs) - len(table), 0)))
        return needs

    def blocks_needed(self, end: int) -> int:
        """Free blocks `prepare(self.length, end)` takes from the pool, over every layer group: new blocks
        and private copies of shared partial ones (a scheduler checks this against pool.free_blocks)."""
        return int(sum(copy + new for copy, new in self._needs(self.length, end)))

    def prepare(self, pos: int, end: int) -> None:
        """Make positions pos .. end - 1 writable in every layer group: new blocks past the tables, a
        private copy of a shared block that pos falls in. Refused (KVCacheFullError), with nothing
        changed, when the pool cannot supply them. Every layer writes the same positions, so only the
        first does work (a copy made then holds the other layers' earlier rows too)."""
        needs = self._needs(pos, end)
        wanted = sum(copy + new for copy, new in needs)
        if not wanted:
            return
        pool = self.pool
        if wanted > pool.free_blocks:
            raise KVCacheFullError(f"the KV block pool is full: positions {pos}..{end - 1} need {wanted} "
                                   f"block(s), {pool.free_blocks} of {pool.n_blocks} are free")
        bs, first = self.block_size, pos // self.block_size
        for g, (copy, new) in enumerate(needs):
            table = self.tables[g]
            if copy:
                private = pool.allocate()
                pool.copy(table[first], private, pos - first * bs)
                pool.release(table[first])
                table[first] = private
            table.extend(pool.allocate() for _ in range(new))
            if copy or new:
                self.table_arrays[g] = np.array(table, np.int32)

    def _release_unseen(self) -> None:
        """Give back the blocks of sliding groups no future query can see (positions before
        length + 1 - window): their table slots become holes."""
        for g, group in enumerate(self.groups):
            if group.window is None:
                continue
            table, changed = self.tables[g], False
            for i in range(self._first_needed(g, self.length)):
                if table[i] != HOLE:
                    self.pool.release(table[i])
                    table[i], changed = HOLE, True
            if changed:
                self.table_arrays[g] = np.array(table, np.int32)

    # -- the KVCache protocol ------------------------------------------------------------------

    def commit(self, n_tokens: int) -> None:
        super().commit(n_tokens)
        self._release_unseen()

    def _state_rows(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """What the state's kernels take for `layer`: its slot's key and value rows, its group's table
        and the block size."""
        group, slot = self.pool.slot_of[layer]
        pool = self.pool
        return pool.key_rows[slot], pool.value_rows[slot], self.table_arrays[group], self.block_size

    def _store(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        if self.state is not None:  # float rows, rounded by the state's kernels (as prealloc's)
            self._store_stored(layer, pos, k, v)
            return
        g = self.geometry
        self._store_stored(layer, pos, self.dtype.encode(k, g), self.dtype.encode(v, g))

    def _store_stored(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray) -> None:
        end, bs = pos + k.shape[0], self.block_size
        self.prepare(pos, end)  # nothing to do when the caller prepared
        if self.state is not None:  # q4_recent, q4_kivi: their stored form is float32 rows (snapshots)
            self.state.write(layer, pos, k, v, *self._state_rows(layer))
            return
        group, slot = self.pool.slot_of[layer]
        table, p = self.tables[group], pos
        keys, values = self.pool.keys[slot], self.pool.values[slot]
        while p < end:
            block, offset = table[p // bs], p % bs
            n = min(bs - offset, end - p)
            keys[block, offset : offset + n] = k[p - pos : p - pos + n]
            values[block, offset : offset + n] = v[p - pos : p - pos + n]
            p += n

    def _check_held(self, layer: int, start: int, end: int) -> None:
        """Refuse positions of a block a sliding group released."""
        group = self.pool.slot_of[layer][0]
        bs = self.block_size
        if (self.table_arrays[group][start // bs : blocks_for(end, bs)] == HOLE).any():
            window = self.groups[group].window
            gone = self._first_needed(group, self.length) * bs
            raise InfernoError(f"layer {layer} slides over {window} positions: positions before {gone} "
                               f"were released, {start} asked for")

    def _stored_span(self, layer: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Stored rows of positions start .. end - 1 of `layer`, gathered from its blocks (a copy)."""
        self._check_held(layer, start, end)
        group, slot = self.pool.slot_of[layer]
        bs, table = self.block_size, self.table_arrays[group]
        blocks = table[start // bs : blocks_for(end, bs)]
        cut = slice(start % bs, start % bs + end - start)
        keys = self.pool.keys[slot, blocks].reshape(-1, self.pool.row_items)[cut]
        return keys, self.pool.values[slot, blocks].reshape(-1, self.pool.row_items)[cut]

    def _rows(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """A gathered copy (snapshots, kv-inspect), as float32; decode reads blocks in place."""
        if self.state is not None:
            self._check_held(layer, 0, self._closed_end(end))
            return self.state.read(layer, 0, end, *self._state_rows(layer))
        keys, values = self._stored_span(layer, 0, end)
        return self.dtype.decode(keys, self.geometry), self.dtype.decode(values, self.geometry)

    def stored_rows(self, layer: int, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        end = self.length if end is None else end
        if end > self._written[layer]:
            raise ValueError(f"layer {layer} holds {self._written[layer]} rows, {end} asked for")
        if self.state is not None:  # snapshots hold q4_recent and q4_kivi rows as float32
            return self._rows(layer, end)
        return self._stored_span(layer, 0, end)

    def _clear(self) -> None:
        for block in self.held_blocks():
            self.pool.release(block)
        self._adopt([[] for _ in self.groups], 0)
        self.published, self._digests = 0, []

    def attend_new(self, layer: int, pos: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Prefill's attention over the rows each query sees: a sliding layer's last `window` only."""
        self.write(layer, pos, k, v)
        window = self.geometry.window(layer)
        start = 0 if window is None else max(pos + 1 - window, 0)
        if self.state is not None:
            keys, values = self.state.read(layer, start, pos + k.shape[0], *self._state_rows(layer))
        else:
            keys, values = self._stored_span(layer, start, pos + k.shape[0])
            keys, values = self.dtype.decode(keys, self.geometry), self.dtype.decode(values, self.geometry)
        return attention.attention_prefill(q, keys, values, self.geometry.heads, pos - start, window=window)

    def attend(self, layer: int, query: np.ndarray, end: int) -> np.ndarray:
        if end > self._written[layer]:
            raise ValueError(f"layer {layer} holds {self._written[layer]} rows, {end} asked for")
        group, slot = self.pool.slot_of[layer]
        ranges = self._memo.get((group, end))
        if ranges is None:  # every layer of a step attends with the same end: one per group and step
            if any(e != end for _, e in self._memo):
                self._memo.clear()
            ranges = self._memo[(group, end)] = self.attention_range(group, end)[None]
        if self.state is not None:
            return self.state.attend(layer, query, int(ranges[0, 0]), end, *self._state_rows(layer))
        pool = self.pool
        return attend_tables(query[None], pool.key_rows[slot], pool.value_rows[slot],
                             self.table_arrays[group][None], ranges, self.block_size, self.geometry.heads,
                             self.dtype.kernel_fmt, self.dtype.rotate)[0]

    def attention_range(self, group: int, end: int) -> np.ndarray:
        """int64 [start, end, span]: the positions a query at end - 1 sees in `group`, and the span of
        positions per parallel task (attention.decode_span, read now: not compiled into the kernel)."""
        window = self.groups[group].window
        start = 0 if window is None else max(end - window, 0)
        return np.array([start, end, attention.decode_span(end - start)], np.int64)
