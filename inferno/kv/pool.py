"""The block pool of `--kv paged`: blocks of K and V rows that many sequences share, and their
accounting: reference counts, the free list and the prefix index (vLLM's automatic prefix caching).

Layers are grouped as vLLM's hybrid allocator groups them (`layer_groups`): every group has the same
number of layers, and the layers of a group share one window (None: global; a sliding-window layer of
Gemma 3 attends over its last `window` positions). A block id is one page of `group_layers` layers:
storage [group_layers, blocks, block_size, row], the layer at slot j of a group reading [j, block].

Full blocks can be published under a hash of their tokens chained to their parent's: a later prompt
starting with the same tokens adopts those blocks instead of prefilling them. A block no sequence holds
keeps its contents and hash until the pool needs it back. The sequences' side (block tables, copy on
write, what q4_recent and q4_kivi keep beside their blocks) is `inferno.kv.paged`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from inferno.errors import InfernoError
from inferno.kv import kivi, recent
from inferno.kv.base import KVCacheFullError
from inferno.kv.dtypes import DTYPES, F32, ElementType, KiviType, RecentType, element_type
from inferno.kv.geometry import KVGeometry
from inferno.kv.memory import lazy_zeros

ITEMSIZE = np.dtype(np.float32).itemsize
BLOCK_SIZE = 16  # tokens per block: vLLM's default
HOLE = -1  # a table slot whose block a sliding group released
PAGED_DTYPES = tuple(DTYPES)  # every element type (q4_recent and q4_kivi with a sequence's `state`)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks holding `tokens` positions."""
    return -(-tokens // block_size)


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The identity of a full block: its tokens and, through the parent's hash, every token before."""
    return hash((parent, tuple(tokens)))


def group_hash(group: int, digest: int) -> int:
    """The prefix index's key of a block of layer group `group` holding the tokens `digest` names."""
    return digest if group == 0 else hash(("group", group, digest))


def paged_element_type(dtype: str) -> ElementType:
    """The element type `dtype` names, refused in one line when a pool cannot hold it."""
    if dtype not in PAGED_DTYPES:
        element_type(dtype)  # an unknown name gets the list of every element type
        raise InfernoError(f"a paged cache holds {', '.join(PAGED_DTYPES)} rows, not {dtype}")
    return element_type(dtype)


def block_rows(dtype: ElementType, geometry: KVGeometry, block_size: int
               ) -> tuple[int, int, type[np.generic]]:
    """Items of one position's K row and V row in a pool's blocks, and their numpy type."""
    if isinstance(dtype, KiviType):
        dtype.row_items(geometry)  # refuses a geometry it cannot store
        if kivi.GROUP % block_size and block_size % kivi.GROUP:
            raise InfernoError(f"a paged q4_kivi cache needs a block size that divides {kivi.GROUP} or is a "
                               f"multiple of it (its key groups), not {block_size}")
        return kivi.key_row_bytes(geometry), kivi.value_row_bytes(geometry), np.uint8
    if isinstance(dtype, RecentType):
        recent.check_geometry(geometry)
        body = recent.body_row_bytes(geometry.kv_width)
        return body, body, np.uint8
    items = dtype.row_items(geometry)
    return items, items, dtype.storage


def sequence_state(dtype: ElementType, geometry: KVGeometry, capacity: int
                   ) -> recent.RecentState | kivi.KiviState | None:
    """What a sequence of `capacity` positions keeps besides its blocks (None: nothing)."""
    if isinstance(dtype, RecentType):
        return recent.RecentState(geometry, capacity)
    if isinstance(dtype, KiviType):
        return kivi.KiviState(geometry, capacity)
    return None


def state_nbytes(dtype: ElementType, geometry: KVGeometry, capacity: int) -> int:
    """Bytes of sequence_state(dtype, geometry, capacity)."""
    if isinstance(dtype, RecentType):
        return recent.sequence_nbytes(geometry, capacity)
    return kivi.sequence_nbytes(geometry) if isinstance(dtype, KiviType) else 0


@dataclass(frozen=True)
class LayerGroup:
    layers: tuple[int, ...]
    window: int | None  # positions each of its layers attends to; None: all of them


def layer_groups(geometry: KVGeometry) -> tuple[LayerGroup, ...]:
    """The layers in groups of one window each, all groups of the same size (the gcd of the counts of
    layers per window, as vLLM's hybrid allocator makes them): global layers first, so group 0 is the
    global one whenever a layer is global. A model without sliding layers is one group of all layers."""
    windows = geometry.windows or (None,) * geometry.layers
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return tuple(LayerGroup(tuple(by_window[w][i : i + size]), w)
                 for w in order for i in range(0, len(by_window[w]), size))


class BlockPool:
    """The blocks sequences share: storage, reference counts, the free list and the prefix index.

    keys, values: [group_layers, n_blocks, block_size, key_items (value_items)] of the element type's
    storage (`block_rows`); a block belongs to one layer group at a time, its slot j holding the rows of
    the group's j-th layer.
    """

    def __init__(self, geometry: KVGeometry, n_blocks: int, block_size: int = BLOCK_SIZE, dtype: str = F32):
        if block_size < 1:
            raise InfernoError(f"a block holds at least one token, got a block size of {block_size}")
        if n_blocks < 1:
            raise InfernoError(f"a block pool needs at least one block, got {n_blocks}")
        self.dtype = paged_element_type(dtype)
        # refuses a geometry (or a block size) the element type cannot store
        self.key_items, self.value_items, storage = block_rows(self.dtype, geometry, block_size)
        self.row_items = self.key_items
        self.grouped = type(self.dtype) is not ElementType  # q4_kivi, q4_recent: a sequence keeps state
        self.geometry = geometry
        self.block_size = block_size
        self.n_blocks = n_blocks
        self.groups = layer_groups(geometry)
        self.group_layers = len(self.groups[0].layers)
        self.slot_of = [(0, 0)] * geometry.layers  # layer -> (its group, its slot in the group's blocks)
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                self.slot_of[layer] = (g, slot)
        shape = (self.group_layers, n_blocks, block_size)
        # pages become resident as blocks are first written
        self.keys = lazy_zeros((*shape, self.key_items), storage)
        self.values = lazy_zeros((*shape, self.value_items), storage)
        # each slot's rows [n_blocks * block_size, items] (views): the attention kernel's rows
        self.key_rows = [self.keys[j].reshape(-1, self.key_items) for j in range(self.group_layers)]
        self.value_rows = [self.values[j].reshape(-1, self.value_items) for j in range(self.group_layers)]
        self.refs = np.zeros(n_blocks, np.int32)
        self._free = list(range(n_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self._idle: OrderedDict[int, int] = OrderedDict()  # unheld published blocks, oldest first -> hash
        self._by_hash: dict[int, int] = {}  # published block hash -> block
        self._hash_of: dict[int, int] = {}

    @staticmethod
    def sequence_blocks(geometry: KVGeometry, tokens: int, block_size: int = BLOCK_SIZE) -> int:
        """Blocks one sequence of `tokens` positions can hold at once: every layer group's blocks for all
        of them (a prompt prefilled in one chunk is held whole, sliding groups included, until commit)."""
        return len(layer_groups(geometry)) * blocks_for(tokens, block_size)

    @classmethod
    def for_tokens(cls, geometry: KVGeometry, tokens: int, block_size: int = BLOCK_SIZE,
                   dtype: str = F32) -> BlockPool:
        return cls(geometry, cls.sequence_blocks(geometry, tokens, block_size), block_size, dtype)

    @staticmethod
    def planned_block_nbytes(geometry: KVGeometry, block_size: int = BLOCK_SIZE, dtype: str = F32) -> int:
        """K and V bytes of one block: block_size rows of every layer of a group."""
        group_layers = len(layer_groups(geometry)[0].layers)
        key_items, value_items, storage = block_rows(paged_element_type(dtype), geometry, block_size)
        return group_layers * block_size * (key_items + value_items) * np.dtype(storage).itemsize

    @cached_property  # read for every sequence's bytes after every step
    def block_nbytes(self) -> int:
        """K and V bytes of one block (a group's layers; all layers when none slides)."""
        return self.planned_block_nbytes(self.geometry, self.block_size, self.dtype.name)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (what it can hold): its storage's."""
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
        """The first `rows` stored rows of block src, every layer of its group, into block dst."""
        self.keys[:, dst, :rows] = self.keys[:, src, :rows]
        self.values[:, dst, :rows] = self.values[:, src, :rows]

    def publish(self, block: int, digest: int) -> None:
        """Make a full block findable by its hash (the first block published under a hash keeps it)."""
        if digest not in self._by_hash and block not in self._hash_of:
            self._by_hash[digest] = block
            self._hash_of[block] = digest

    def lookup(self, digest: int) -> int | None:
        return self._by_hash.get(digest)
