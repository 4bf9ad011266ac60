"""The longest prefix every deciding group can serve: one pure function, used by the engine's coordinator over its
block pools and by the proxy's cache-aware routing over the hashes a node's KV events announced."""

from __future__ import annotations

import math
from collections.abc import Sequence

from typing import Protocol

from hybridpd.engine.kv_cache.hashing import BlockHash


class GroupHits(Protocol):
    """One group's answer to "how long a prefix can you serve": a manager, or an index of a node's group."""

    block_size: int

    @property
    def downward_closed(self) -> bool: ...

    def longest_hit(self, hashes: Sequence[BlockHash], max_tokens: int, alignment: int) -> int: ...


def find_common_hit(managers: Sequence[GroupHits], chains: Sequence[Sequence[BlockHash]], max_tokens: int) -> int:
    """Fixed-point search over groups, aligned to the LCM of their block sizes.

    Each group answers the largest aligned L <= candidate that it can serve. Window and Mamba hits are not
    downward-closed, so a group's shorter answer can invalidate another group's earlier one: repeat until a full
    pass leaves the candidate unchanged. Then every group accepted it; it is the longest such length because
    any length all groups serve stays <= every answer (each answer is a maximum). The candidate only shrinks,
    by at least the alignment per changing pass, and 0 is accepted by all, so the loop ends.

    A downward-closed group (full attention) that once answered A accepts every aligned candidate <= A, so it
    is not asked again.
    """
    if not managers or max_tokens <= 0:
        return 0
    alignment = math.lcm(*(m.block_size for m in managers))
    candidate = max_tokens // alignment * alignment
    accepted_up_to = [-1] * len(managers)
    while candidate > 0:
        before = candidate
        for i, (manager, hashes) in enumerate(zip(managers, chains)):
            if candidate <= accepted_up_to[i]:
                continue
            candidate = manager.longest_hit(hashes, candidate, alignment)
            if manager.downward_closed:
                accepted_up_to[i] = candidate
            if candidate == 0:
                return 0
        if candidate == before:
            return candidate
    return 0
