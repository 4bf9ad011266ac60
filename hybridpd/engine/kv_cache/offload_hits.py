"""Hits over memory and the storage tier together: every kind's own rule, asked of a union predicate.

A block counts as present if the group's pool holds it or the storage tier does (`Offloaded`, a set lookup: no
I/O). The fixed point of hit_search.find_common_hit then gives the longest prefix every group can serve from the
two tiers together; what memory lacks of it is loaded from storage before the request computes on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridpd.engine.kv_cache.hashing import BlockHash
from hybridpd.engine.kv_cache.single_type import SingleTypeManager

Offloaded = Callable[[int, BlockHash], bool]   # (group index, block hash) -> the storage tier holds it


class StorageIndex(Protocol):
    """What the hit search asks of the storage tier (kv_offload/tier.py): no I/O in either."""

    def has(self, group: int, block_hash: bytes) -> bool: ...

    @property
    def empty(self) -> bool:
        """It holds no block at all (then no search over it is needed)."""


@dataclass(frozen=True)
class WithStorage:
    """A group's hit rule over its pool and the storage tier (the hit_search.GroupHits protocol)."""

    manager: SingleTypeManager
    group: int
    offloaded: Offloaded

    @property
    def block_size(self) -> int:
        return self.manager.block_size

    @property
    def downward_closed(self) -> bool:
        return self.manager.downward_closed

    def present(self, block_hash: BlockHash) -> bool:
        return self.manager.present(block_hash) or self.offloaded(self.group, block_hash)

    def longest_hit(self, hashes: Sequence[BlockHash], max_tokens: int, alignment: int) -> int:
        if not self.manager.caching:
            return 0
        return self.manager.rule.longest_hit(self.present, hashes, max_tokens, alignment)
