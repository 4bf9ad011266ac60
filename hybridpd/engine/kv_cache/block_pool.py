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

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from hybridpd.engine.kv_cache.hashing import BlockHash

if TYPE_CHECKING:
    from hybridpd.engine.kv_cache.budget import PageBudget
    from hybridpd.engine.kv_cache.residency import PoolResidency

NULL_BLOCK_ID = 0


class KVCacheInvariantError(AssertionError):
    """The pool's bookkeeping is inconsistent (a bug, not bad input): raised by `check_invariants`."""


class BlockPool:
    def __init__(self, num_blocks: int, on_removed: Callable[[BlockHash], None] | None = None, *,
                 budget: PageBudget | None = None, page_bytes: int = 0,
                 on_released: Callable[[int], None] | None = None, cached_cap: int | None = None,
                 residency: PoolResidency | None = None) -> None:
        """`budget`: share it with other pools (blocks of `page_bytes` each, none resident yet); `cached_cap`: a
        best-effort allocation takes another pool's cached block only while this one holds fewer cached blocks;
        `residency`: hears every allocation, prefix hit and memory handed back (residency.py)."""
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}")
        if budget is not None and page_bytes < 1:
            raise ValueError(f"a pool that shares a budget needs its page size, got {page_bytes}")
        self._size = num_blocks
        self._refs = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._on_removed = on_removed
        self.page_bytes = page_bytes
        self._budget = budget
        self._on_released = on_released
        self._cached_cap = cached_cap
        self._residency = residency
        if budget is None:
            self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
            self._spare: list[int] = []
        else:
            self._free = OrderedDict()
            self._spare = list(range(num_blocks - 1, 0, -1))   # popped lowest first
            budget.join(self)
        self._uncached_free = len(self._free)
        self._stamps = [0] * num_blocks if budget is not None else []   # when each cached block was freed

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self._size - 1

    @property
    def num_free(self) -> int:
        """Blocks an allocation could take now (cached ones included: they are evictable)."""
        if self._budget is None:
            return len(self._free)
        return len(self._free) + self._growth(self._budget.reclaimable(self, cached=True))

    def available(self, *, best_effort: bool) -> int:
        """`num_free`, or for a best-effort allocation: other pools' cached blocks only below the cap."""
        if not best_effort or self._budget is None or self._may_take_others_cached():
            return self.num_free
        return len(self._free) + self._growth(self._budget.reclaimable(self, cached=False))

    def _growth(self, reclaimable: int) -> int:
        assert self._budget is not None
        return min(len(self._spare), (self._budget.room + reclaimable) // self.page_bytes)

    def _may_take_others_cached(self) -> bool:
        return self._cached_cap is None or len(self._cached) < self._cached_cap

    @property
    def num_resident_free(self) -> int:
        return len(self._free)

    @property
    def num_uncached_free(self) -> int:
        return self._uncached_free

    @property
    def num_spare(self) -> int:
        """Ids not resident: what the pool could still grow by."""
        return len(self._spare)

    @property
    def num_held(self) -> int:
        """Blocks with a reference."""
        return self._size - 1 - len(self._free) - len(self._spare)

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
                self._dequeue(b)
            self._refs[b] += 1
            if self._residency is not None:
                self._residency.accessed(b)

    def allocate(self, n: int, *, best_effort: bool = False) -> list[int]:
        """n blocks with reference 1, evicting (un-hashing) cached ones as needed (budget.py says in which order).
        Caller checks `num_free` (or `available(best_effort=True)`)."""
        if n > self.available(best_effort=best_effort):
            raise ValueError(f"cannot allocate {n} blocks, only {self.available(best_effort=best_effort)} free")
        out = []
        for _ in range(n):
            b = self._take(best_effort)
            self._refs[b] = 1
            out.append(b)
            if self._residency is not None:
                self._residency.allocated(b)
        return out

    def _take(self, best_effort: bool) -> int:
        budget = self._budget
        if self._free and self._hashes[next(iter(self._free))] is None:
            return self._pop_front()
        if budget is None or not self._spare:
            if self._free:
                return self._pop_front()
            raise ValueError("no free block (allocate checks the count first: a bookkeeping bug)")
        if budget.make_room(self, self.page_bytes):
            return self._grow()
        others = not best_effort or self._may_take_others_cached()
        while True:   # the least recently freed cached block: this pool's own, or another's to pay with
            oldest = budget.least_recent(budget.pools if others else [self])
            if oldest is None:
                raise ValueError("no free block (allocate checks the count first: a bookkeeping bug)")
            if oldest is self:
                return self._pop_front()
            oldest.give_back(uncached_only=False)
            if budget.room >= self.page_bytes:
                return self._grow()

    def upcoming(self, n: int) -> list[int]:
        """Up to n blocks the next allocations will take whose memory may not be written yet: a shared pool's
        spare ids in the order it grows into them (its free blocks were all written once), else the front of the
        free queue (at first every block, in order)."""
        if self._budget is not None:
            return self._spare[: -n - 1 : -1]
        return list(itertools.islice(self._free, n))

    def front_stamp(self) -> int:
        """When the first free block was freed (uncached free blocks count as oldest: they are worth nothing)."""
        b = next(iter(self._free))
        return -1 if self._hashes[b] is None else self._stamps[b]

    def _grow(self) -> int:
        assert self._budget is not None
        self._budget.used += self.page_bytes
        return self._spare.pop()

    def _pop_front(self) -> int:
        """The first free block, un-hashed."""
        b = next(iter(self._free))
        self._dequeue(b)
        old = self._hashes[b]
        if old is not None:
            del self._cached[old]
            self._hashes[b] = None
            if self._on_removed is not None:
                self._on_removed(old)
        return b

    def _dequeue(self, b: int) -> None:
        del self._free[b]
        if self._hashes[b] is None:
            self._uncached_free -= 1

    def give_back(self, *, uncached_only: bool) -> bool:
        """Hand the first free block's bytes back to the budget (False if there is none, or it is cached and
        `uncached_only`): its hash stops being a hit and its memory is released."""
        if self._budget is None or not self._free:
            return False
        if uncached_only and self._hashes[next(iter(self._free))] is not None:
            return False
        b = self._pop_front()
        self._spare.append(b)
        self._budget.used -= self.page_bytes
        if self._residency is not None:
            self._residency.ended(b)
        if self._on_released is not None:
            self._on_released(b)
        return True

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
                    self._uncached_free += 1
                elif self._budget is not None:
                    self._stamps[b] = self._budget.tick()

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
                self._uncached_free += 1
                if self._on_removed is not None:
                    self._on_removed(h)

    def check_invariants(self, expected_refs: Mapping[int, int]) -> None:
        """`expected_refs`: block id -> how many table entries of running requests hold it (null excluded)."""
        if self._refs[NULL_BLOCK_ID] != 0 or NULL_BLOCK_ID in self._free or self._hashes[NULL_BLOCK_ID] is not None:
            raise KVCacheInvariantError("the null block was freed, referenced or hashed")
        refs = Counter({b: n for b, n in expected_refs.items() if b != NULL_BLOCK_ID})
        spare = set(self._spare)
        for b in range(1, self._size):
            if self._refs[b] != refs.get(b, 0):
                raise KVCacheInvariantError(f"block {b}: reference count {self._refs[b]} but {refs.get(b, 0)} owners")
            if (self._refs[b] == 0) != (b in self._free or b in spare):
                raise KVCacheInvariantError(f"block {b}: reference count {self._refs[b]}, in free queue: {b in self._free}")
        used = sum(1 for b in range(1, self._size) if self._refs[b] > 0)
        if used + len(self._free) + len(self._spare) != self.num_blocks:
            raise KVCacheInvariantError(
                f"free {len(self._free)} + used {used} + not resident {len(self._spare)} != total {self.num_blocks}")
        if any(self._refs[b] or self._hashes[b] is not None or b in self._free for b in self._spare):
            raise KVCacheInvariantError("a block that is not resident is referenced, hashed or queued as free")
        if sum(1 for b in self._free if self._hashes[b] is None) != self._uncached_free:
            raise KVCacheInvariantError(f"the count of uncached free blocks ({self._uncached_free}) is wrong")
        for h, b in self._cached.items():
            if self._hashes[b] != h:
                raise KVCacheInvariantError(f"hash map points at block {b}, which holds another hash")
        if sum(1 for h in self._hashes if h is not None) != len(self._cached):
            raise KVCacheInvariantError("a block holds a hash the hash map does not know")
