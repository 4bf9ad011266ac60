"""One byte budget that block pools of different page sizes share: memory goes to whichever group needs it.

Each pool sharing a budget has a *virtual* range of block ids, more than the budget could hold at once; a block
is *resident* (it counts against the budget) from its first allocation until the pool gives it back. Nothing is
set aside per group at start-up: a Mamba running slot is taken as its request is admitted, attention blocks as
tokens arrive, and a cached block of one group is reclaimed when another group needs the bytes (its physical pages
go back to the operating system, `on_released`). There is no fragmentation to manage: block ids are virtual, so a
21 MiB Mamba slot can be paid for with any 170 free attention blocks, wherever they sit.

Where a block comes from, cheapest first (`BlockPool.allocate`): the pool's own uncached free blocks, the budget's
unused bytes, other pools' uncached free blocks, then the least recently freed cached block of any pool sharing the
budget (one LRU over every group, as one free queue of pages would give; a block of another group is reclaimed and
its bytes pay for new ones). A best-effort allocation (a Mamba state saved for the prefix cache) takes another
pool's cached block only while its pool holds fewer cached blocks than its cap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridpd.engine.kv_cache.block_pool import BlockPool


class PageBudget:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"a page budget needs at least one byte, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.used = 0
        self.pools: list[BlockPool] = []
        self._clock = 0

    def join(self, pool: BlockPool) -> None:
        self.pools.append(pool)

    @property
    def room(self) -> int:
        """Bytes no pool holds."""
        return self.capacity - self.used

    def held_bytes(self) -> int:
        """Bytes of blocks that requests hold (resident and referenced)."""
        return sum(p.num_held * p.page_bytes for p in self.pools)

    def reclaimable(self, besides: BlockPool, *, cached: bool) -> int:
        """Bytes the other pools' free blocks would give (only their uncached ones unless `cached`)."""
        return sum((p.num_resident_free if cached else p.num_uncached_free) * p.page_bytes
                   for p in self.pools if p is not besides)

    def fits(self, demands: Mapping[BlockPool, int], reserve: int = 0) -> bool:
        """Can every pool get its number of new blocks at once (each from its own free blocks first), with `reserve`
        bytes still free or reclaimable after?"""
        short = surplus = 0
        for pool in self.pools:
            need = demands.get(pool, 0)
            own = pool.num_resident_free
            if need > own + pool.num_spare:
                return False
            if need > own:
                short += (need - own) * pool.page_bytes
            else:
                surplus += (own - need) * pool.page_bytes
        return short + reserve <= self.room + surplus

    def tick(self) -> int:
        """The next stamp of the shared LRU (a cached block's stamp says when it was last freed)."""
        self._clock += 1
        return self._clock

    def make_room(self, pool: BlockPool, nbytes: int) -> bool:
        """Reclaim other pools' uncached free blocks until `nbytes` are unused. False (having reclaimed what it could)
        if there are not enough."""
        others = [p for p in self.pools if p is not pool and p.num_uncached_free]
        while self.room < nbytes and others:
            donor = others[-1]
            donor.give_back(uncached_only=True)
            if not donor.num_uncached_free:
                others.pop()
        return self.room >= nbytes

    def least_recent(self, pools: list[BlockPool]) -> BlockPool | None:
        """Of `pools`, the one whose first free block was freed longest ago (None if none has a free block)."""
        return min((p for p in pools if p.num_resident_free), key=lambda p: p.front_stamp(), default=None)
