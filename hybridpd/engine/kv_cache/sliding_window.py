"""Sliding window W: query i sees key j iff i - W < j <= i.

A hit of L tokens means the next query (position L) can run, so only the blocks covering positions
[max(0, L-W+1), L) must be cached; the blocks before them are NULL_BLOCK_ID. Such hits are not downward-closed
(a shorter L may need a block a longer one does not), so the search runs right-to-left.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridpd.engine.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool
from hybridpd.engine.kv_cache.hashing import BlockHash
from hybridpd.engine.kv_cache.single_type import FRESH, GroupPlan, SingleTypeManager, TokenRange, cdiv
from hybridpd.engine.kv_cache.spec import SlidingWindowSpec


class SlidingWindowManager(SingleTypeManager):
    search_order = 1

    def __init__(self, spec: SlidingWindowSpec, pool: BlockPool, *, caching: bool) -> None:
        super().__init__(spec, pool, caching=caching)
        self.window = spec.sliding_window
        self.first_visible_block = spec.hit_rule().first_visible_block  # the first block a query at a position sees
        self._first_live: dict[str, int] = {}   # logical blocks below this one are NULL_BLOCK_ID (released)

    def hit_blocks(self, hashes: Sequence[BlockHash], num_tokens: int) -> tuple[int, ...]:
        first = self.first_visible_block(num_tokens)
        found = tuple(self.pool.lookup(hashes[i]) for i in range(first, num_tokens // self.block_size))
        return (NULL_BLOCK_ID,) * first + found  # type: ignore[operator]

    def plan(self, request_id: str, hit_blocks: tuple[int, ...], tokens: TokenRange,
             hashes: Sequence[BlockHash]) -> GroupPlan:
        need = cdiv(tokens.end, self.block_size)
        if not tokens.first:
            return self._plan_growth(request_id, need)
        if tokens.external:
            return self._plan_external(tokens, hashes, need)
        self._check_attention_hit(hashes, hit_blocks, tokens.hit)
        return GroupPlan(append=hit_blocks + (FRESH,) * (need - len(hit_blocks)))

    def _plan_external(self, tokens: TokenRange, hashes: Sequence[BlockHash], need: int) -> GroupPlan:
        """Tokens before `start` exist elsewhere: only the blocks the query at `start` sees get a block, taken
        from the local cache when held there under the right hash, else fresh and loaded."""
        b, start = self.block_size, tokens.start
        first = self.first_visible_block(start)
        entries = [NULL_BLOCK_ID] * first
        load = []
        for i in range(first, cdiv(start, b)):
            held = self.pool.lookup(hashes[i]) if self.caching and (i + 1) * b <= start and i < len(hashes) else None
            if held is None:
                entries.append(FRESH)
                load.append(i)
            else:
                entries.append(held)
        entries.extend([FRESH] * (need - len(entries)))
        return GroupPlan(append=tuple(entries), load=tuple(load))

    def quiet(self, request_id: str, start: int, end: int) -> bool:
        """Also: the commit at `end` releases no block that fell out of the window."""
        table = self._tables.get(request_id)
        return super().quiet(request_id, start, end) and (
            min(self.first_visible_block(end), len(table)) <= self._first_live.get(request_id, 0)  # type: ignore[arg-type]
        )

    def commit(self, request_id: str, num_computed: int, hashes: Sequence[BlockHash]) -> list[int]:
        """Cache the full blocks, then release every block no future query (position >= num_computed) sees."""
        stored = super().commit(request_id, num_computed, hashes)
        table = self._tables.get(request_id)
        if table is None:
            return stored
        start = self._first_live.get(request_id, 0)
        upto = min(self.first_visible_block(num_computed), len(table))
        if upto <= start:  # the window has not left another block behind (most steps)
            return stored
        released = [table[i] for i in range(start, upto) if table[i] != NULL_BLOCK_ID]
        table[start:upto] = [NULL_BLOCK_ID] * (upto - start)
        self.pool.free(released)
        self._first_live[request_id] = upto
        return stored

    def free(self, request_id: str) -> None:
        self._first_live.pop(request_id, None)
        super().free(request_id)
