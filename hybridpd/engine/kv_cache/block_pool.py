"""One group's block pool: reference counts, an LRU free queue, and the hash -> block map of the prefix cache.

Block 0 is the null block: it stands for "no block here" (a sliding-window block out of the window), is never
allocated, never freed and never hashed.

The free queue holds exactly the blocks with reference count 0. Uncached free blocks sit at its front (they are
worth nothing, so they are reused first); a cached block goes to the back when its last reference is dropped,
so popping from the front evicts the least recently freed cached block. A freed block keeps its hash, and can
be taken back by a prefix hit (`touch`), until it is evicted. `on_removed`, if given, hears every hash that stops
being a hit (evicted or reset), at the moment it happens.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping

from hybridpd.engine.kv_cache.hashing import BlockHash

NULL_BLOCK_ID = 0


class KVCacheInvariantError(AssertionError):
    """The pool's bookkeeping is inconsistent (a bug, not bad input): raised by `check_invariants`."""


class BlockPool:
    def __init__(self, num_blocks: int, on_removed: Callable[[BlockHash], None] | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}")
        self._size = num_blocks
        self._refs = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._on_removed = on_removed

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self._size - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def cached_hashes(self) -> frozenset[BlockHash]:
        return frozenset(self._cached)

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hashes[block_id]

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def free_blocks_consumed(self, block_ids: Iterable[int]) -> int:
        """How many free blocks `touch(block_ids)` would take out of the free queue (distinct ids)."""
        return sum(1 for b in set(block_ids) if b != NULL_BLOCK_ID and self._refs[b] == 0)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one reference on each (cached) block; a free one leaves the free queue but keeps its hash."""
        for b in block_ids:
            if b == NULL_BLOCK_ID:
                continue
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def allocate(self, n: int) -> list[int]:
        """n blocks with reference 1, evicting (un-hashing) cached ones as needed. Caller checks `num_free`."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            old = self._hashes[b]
            if old is not None:
                del self._cached[old]
                self._hashes[b] = None
                if self._on_removed is not None:
                    self._on_removed(old)
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in order: of the cached ones, the first given is evicted first."""
        for b in block_ids:
            if b == NULL_BLOCK_ID:
                continue
            if self._refs[b] <= 0:
                raise KVCacheInvariantError(f"block {b} freed with reference count {self._refs[b]}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None
                if self._hashes[b] is None:
                    self._free.move_to_end(b, last=False)

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a held block under its hash. True if that made a new hit; False (and no change) if the block is
        registered already or another block holds that hash."""
        if block_id == NULL_BLOCK_ID or self._refs[block_id] == 0:
            raise KVCacheInvariantError(f"only a held block can be cached, not block {block_id}")
        if self._hashes[block_id] is not None or block_hash in self._cached:
            return False
        self._cached[block_hash] = block_id
        self._hashes[block_id] = block_hash
        return True

    def reset_cache(self) -> None:
        """Forget the hashes of every free block (held blocks keep theirs)."""
        for b in list(self._free):
            h = self._hashes[b]
            if h is not None:
                del self._cached[h]
                self._hashes[b] = None
                self._free.move_to_end(b, last=False)
                if self._on_removed is not None:
                    self._on_removed(h)

    def check_invariants(self, expected_refs: Mapping[int, int]) -> None:
        """`expected_refs`: block id -> how many table entries of running requests hold it (null excluded)."""
        if self._refs[NULL_BLOCK_ID] != 0 or NULL_BLOCK_ID in self._free or self._hashes[NULL_BLOCK_ID] is not None:
            raise KVCacheInvariantError("the null block was freed, referenced or hashed")
        refs = Counter({b: n for b, n in expected_refs.items() if b != NULL_BLOCK_ID})
        for b in range(1, self._size):
            if self._refs[b] != refs.get(b, 0):
                raise KVCacheInvariantError(f"block {b}: reference count {self._refs[b]} but {refs.get(b, 0)} owners")
            if (self._refs[b] == 0) != (b in self._free):
                raise KVCacheInvariantError(f"block {b}: reference count {self._refs[b]}, in free queue: {b in self._free}")
        used = sum(1 for b in range(1, self._size) if self._refs[b] > 0)
        if used + len(self._free) != self.num_blocks:
            raise KVCacheInvariantError(f"free {len(self._free)} + used {used} != total {self.num_blocks}")
        for h, b in self._cached.items():
            if self._hashes[b] != h:
                raise KVCacheInvariantError(f"hash map points at block {b}, which holds another hash")
        if sum(1 for h in self._hashes if h is not None) != len(self._cached):
            raise KVCacheInvariantError("a block holds a hash the hash map does not know")
