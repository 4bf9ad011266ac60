"""What every per-kind manager shares: a request's block table in one group, and the two-phase allocation.

Allocation is planned first (`plan`, which reads the pool but changes nothing) and applied second (`apply`), so
that the coordinator can refuse a step that does not fit in *every* group without having changed any of them.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpd.engine.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool
from hybridpd.engine.kv_cache.cache_types import MambaStepOps
from hybridpd.engine.kv_cache.hashing import BlockHash
from hybridpd.config import CacheConfig
from hybridpd.engine.kv_cache.spec import KVCacheSpec

FRESH = -1  # a table entry of a plan that takes a new block from the free queue


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, kw_only=True)
class TokenRange:
    """The tokens of one allocate_slots call.

    First call: [0, hit) is the local hit, [hit, start) arrives from the connector (when `external`), and
    [start, end) is computed here. Later calls: [start, end) is computed here, everything before is held.
    """

    first: bool
    hit: int
    start: int
    end: int
    external: bool
    num_prompt: int = 0   # first call: the prompt's length, and the prefix full attention found cached
    shared: int = 0


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    append: tuple[int, ...]    # entries appended to the table: a cached block id (referenced), NULL_BLOCK_ID, FRESH
    load: tuple[int, ...] = () # logical indices to fill from the remote node
    copy_from: int | None = None                       # Mamba: cached slot to reference and copy from
    saves: tuple[tuple[int, BlockHash], ...] = ()      # Mamba: (num_tokens, hash) wanted, best effort

    @property
    def touched(self) -> tuple[int, ...]:
        held = tuple(b for b in self.append if b > NULL_BLOCK_ID)
        return held if self.copy_from is None else held + (self.copy_from,)

    def free_blocks_needed(self, pool: BlockPool) -> int:
        """Free-queue blocks this plan needs (saves excluded: they are best effort)."""
        if not self.append and self.copy_from is None:  # the usual decode step: nothing new to hold
            return 0
        return self.append.count(FRESH) + pool.free_blocks_consumed(self.touched)


@dataclass(frozen=True, kw_only=True)
class GroupStep:
    table: tuple[int, ...]
    mamba: MambaStepOps | None
    load: tuple[tuple[int, int], ...]


class StaleHitError(ValueError):
    """A CacheHit whose blocks were evicted before allocate_slots used it (get it again, then allocate)."""


class SingleTypeManager(abc.ABC):
    """Block tables of the running requests in one group; per-kind hit search and allocation rules."""

    decides_remote_hit = False   # True: this kind limits the hit of a remotely prefilled request
    search_order = 0             # cheap, downward-closed kinds first: they shrink the candidate fastest

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, *, caching: bool) -> None:
        self.spec = spec
        self.pool = pool
        self.block_size = spec.block_size
        self.caching = caching
        self._tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}   # logical blocks already offered to the prefix cache
        self.rule = spec.hit_rule()

    @classmethod
    def build(cls, spec: KVCacheSpec, pool: BlockPool, *, caching: bool, config: CacheConfig) -> SingleTypeManager:
        """The manager of one group (a kind that reads more of the cache config overrides this)."""
        return cls(spec, pool, caching=caching)

    def present(self, block_hash: BlockHash) -> bool:
        """Is `block_hash` a hit in this group's pool (the predicate the hit rule reads)."""
        return self.pool.lookup(block_hash) is not None

    # --- hit search (reads only) ---
    @property
    def downward_closed(self) -> bool:
        return self.rule.downward_closed

    def longest_hit(self, hashes: Sequence[BlockHash], max_tokens: int, alignment: int) -> int:
        """The largest L <= max_tokens, a multiple of `alignment`, that this group can serve (0 always can)."""
        return self.rule.longest_hit(self.present, hashes, max_tokens, alignment)

    @abc.abstractmethod
    def hit_blocks(self, hashes: Sequence[BlockHash], num_tokens: int) -> tuple[int, ...]:
        """The blocks that serve a hit of `num_tokens` (which `longest_hit` accepted)."""

    # --- allocation ---
    @abc.abstractmethod
    def plan(self, request_id: str, hit_blocks: tuple[int, ...], tokens: TokenRange,
             hashes: Sequence[BlockHash]) -> GroupPlan:
        """What this call needs; reads the pool, changes nothing."""

    def apply(self, request_id: str, plan: GroupPlan) -> GroupStep:
        """The plan's required blocks (its touched ones must be referenced first: the coordinator does it)."""
        table = self._tables.get(request_id)
        if table is None:
            table = self._tables[request_id] = []
            self._num_hashed[request_id] = 0
        if plan.append:   # the plan's `touched` blocks are referenced already (by the coordinator, for all groups)
            fresh = iter(self.pool.allocate(plan.append.count(FRESH)))
            table.extend(next(fresh) if b == FRESH else b for b in plan.append)
        load = tuple((i, table[i]) for i in plan.load) if plan.load else ()
        return GroupStep(table=tuple(table), mamba=None, load=load)

    def add_saves(self, request_id: str, plan: GroupPlan, step: GroupStep) -> GroupStep:
        """The plan's best-effort allocations, after every group's required ones (only Mamba has any)."""
        return step

    def quiet(self, request_id: str, start: int, end: int) -> bool:
        """True if a later step computing tokens [start, end) needs no new block here and its commit (at `end`)
        has nothing to do: then the request's table stays as it is (most decode steps). May say False where the
        full path would find nothing to do; never True where it would do something."""
        table = self._tables.get(request_id)
        return table is not None and cdiv(end, self.block_size) <= len(table) and (
            not self.caching or end // self.block_size <= self._num_hashed[request_id]
        )

    def quiet_ops(self, request_id: str) -> MambaStepOps | None:
        """The Mamba ops of a quiet step (None: an attention group has none)."""
        return None

    def commit(self, request_id: str, num_computed: int, hashes: Sequence[BlockHash]) -> list[int]:
        """Offer the newly full, computed blocks to the prefix cache; returns the chain indices that became hits."""
        table = self._tables.get(request_id)
        if table is None:
            return []
        done = self._num_hashed[request_id]
        full = min(num_computed // self.block_size, len(table), len(hashes))
        stored = []
        if self.caching:
            for i in range(done, full):
                if table[i] != NULL_BLOCK_ID and self.pool.cache(table[i], hashes[i]):
                    stored.append(i)
        self._num_hashed[request_id] = max(done, full)
        return stored

    def free(self, request_id: str) -> None:
        """Everything back to the pool, tail first (so the tail of a prefix is evicted before its head)."""
        table = self._tables.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        if table is not None:
            self.pool.free(reversed(table))

    def table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tables.get(request_id, ()))

    def request_ids(self) -> set[str]:
        return set(self._tables)

    def owned(self) -> Counter[int]:
        """Block id -> number of references the running requests hold (for the invariant check)."""
        refs: Counter[int] = Counter()
        for table in self._tables.values():
            refs.update(b for b in table if b != NULL_BLOCK_ID)
        return refs

    def _plan_growth(self, request_id: str, need: int) -> GroupPlan:
        """A later call of an attention kind: fresh blocks up to `need` in all."""
        have = len(self._tables.get(request_id, ()))
        return GroupPlan(append=(FRESH,) * max(0, need - have))

    def _check_attention_hit(self, hashes: Sequence[BlockHash], hit_blocks: Sequence[int], hit: int) -> None:
        """One block per logical block of an attention hit (NULL_BLOCK_ID where a window no longer needs it), each
        still holding its hash."""
        if len(hit_blocks) != hit // self.block_size:
            raise ValueError(f"a hit of {hit} tokens needs {hit // self.block_size} blocks, got {len(hit_blocks)}")
        self._check_hit(hashes, range(len(hit_blocks)), hit_blocks)

    def _check_hit(self, hashes: Sequence[BlockHash], positions: Sequence[int], blocks: Sequence[int]) -> None:
        for i, b in zip(positions, blocks):
            if b != NULL_BLOCK_ID and (i >= len(hashes) or self.pool.block_hash(b) != hashes[i]):
                raise StaleHitError(f"hit block {b} no longer holds logical block {i}; ask get_computed_blocks again")
