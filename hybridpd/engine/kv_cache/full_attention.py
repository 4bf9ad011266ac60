"""Full attention: a hit is the longest run of cached blocks from the left (downward-closed)."""

from __future__ import annotations

from collections.abc import Sequence

from hybridpd.engine.kv_cache.hashing import BlockHash
from hybridpd.engine.kv_cache.single_type import FRESH, GroupPlan, SingleTypeManager, TokenRange, cdiv


class FullAttentionManager(SingleTypeManager):
    decides_remote_hit = True
    search_order = 0

    def hit_blocks(self, hashes: Sequence[BlockHash], num_tokens: int) -> tuple[int, ...]:
        return tuple(self.pool.lookup(h) for h in hashes[: num_tokens // self.block_size])  # type: ignore[misc]

    def plan(self, request_id: str, hit_blocks: tuple[int, ...], tokens: TokenRange,
             hashes: Sequence[BlockHash]) -> GroupPlan:
        b = self.block_size
        need = cdiv(tokens.end, b)
        if not tokens.first:
            return self._plan_growth(request_id, need)
        self._check_attention_hit(hashes, hit_blocks, tokens.hit)
        load = tuple(range(len(hit_blocks), cdiv(tokens.start, b))) if tokens.external else ()
        return GroupPlan(append=hit_blocks + (FRESH,) * (need - len(hit_blocks)), load=load)
