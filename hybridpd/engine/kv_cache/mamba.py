"""Mamba: one running state slot per request; in `align` mode, cached states every `interval` tokens.

The group's block size is the interval B; a cached state for the prefix of k*B tokens is hashed with hash
number k-1 of the request's chain of block size B. A step that crosses boundaries k*B gets a save slot per
boundary (best effort: a save that finds no free slot is skipped, it never fails the step, and it never takes the
running slot of a request the scheduler may still admit in this step, see `expect_admissions`); on commit the saved
states are hashed and released into the LRU free queue. A hit slot is referenced until the step that copies it
into the running slot is committed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from hybridpd.config import CacheConfig, MambaRetentionPolicy
from hybridpd.engine.kv_cache.block_pool import BlockPool
from hybridpd.engine.kv_cache.cache_types import MambaStepOps
from hybridpd.engine.kv_cache.hashing import BlockHash
from hybridpd.engine.kv_cache.retention import MambaRetention
from hybridpd.engine.kv_cache.single_type import FRESH, GroupPlan, GroupStep, SingleTypeManager, TokenRange
from hybridpd.engine.kv_cache.spec import MambaSpec


class MambaManager(SingleTypeManager):
    search_order = 2

    def __init__(self, spec: MambaSpec, pool: BlockPool, *, caching: bool,
                 retention: MambaRetentionPolicy = MambaRetentionPolicy.SPARSE) -> None:
        super().__init__(spec, pool, caching=caching)
        self._owed = 0            # running slots owed to admissions expected in this step ...
        self._tables_before = 0   # ... counted down as requests get their running slot
        self._every = retention is MambaRetentionPolicy.EVERY
        self._copy_from: dict[str, int] = {}                              # hit slot held until commit
        self._saves: dict[str, list[tuple[int, int, BlockHash]]] = {}     # (num_tokens, slot, hash) pending
        self._retention: dict[str, MambaRetention] = {}                   # which boundaries each request saves

    @classmethod
    def build(cls, spec: MambaSpec, pool: BlockPool, *, caching: bool, config: CacheConfig) -> MambaManager:
        return cls(spec, pool, caching=caching, retention=config.mamba_retention)

    def longest_hit(self, hashes: Sequence[BlockHash], max_tokens: int, alignment: int) -> int:
        if not self.caching:
            return 0
        return self.rule.longest_hit(self.present, hashes, max_tokens, alignment)

    def hit_blocks(self, hashes: Sequence[BlockHash], num_tokens: int) -> tuple[int, ...]:
        if num_tokens == 0:
            return ()
        return (self.pool.lookup(hashes[num_tokens // self.block_size - 1]),)  # type: ignore[return-value]

    def plan(self, request_id: str, hit_blocks: tuple[int, ...], tokens: TokenRange,
             hashes: Sequence[BlockHash]) -> GroupPlan:
        if tokens.first and self.caching:
            self._retention[request_id] = MambaRetention(tokens.num_prompt, tokens.shared, self.block_size,
                                                         every=self._every)
        saves = self._wanted_saves(request_id, tokens, hashes)
        if not tokens.first:
            return GroupPlan(append=(), saves=saves)
        if tokens.external:
            return GroupPlan(append=(FRESH,), load=(0,), saves=saves)
        if hit_blocks:
            if tokens.hit % self.block_size or len(hit_blocks) != 1:
                raise ValueError(f"a Mamba hit of {tokens.hit} tokens needs one slot at a multiple of {self.block_size}")
            self._check_hit(hashes, (tokens.hit // self.block_size - 1,), hit_blocks)
            return GroupPlan(append=(FRESH,), copy_from=hit_blocks[0], saves=saves)
        if tokens.hit:
            raise ValueError(f"a hit of {tokens.hit} tokens without a Mamba state to copy")
        return GroupPlan(append=(FRESH,), saves=saves)

    def _wanted_saves(self, request_id: str, tokens: TokenRange,
                      hashes: Sequence[BlockHash]) -> tuple[tuple[int, BlockHash], ...]:
        """Boundaries k*B with start < k*B <= end that the request's retention keeps and are not cached yet."""
        retention = self._retention.get(request_id)
        if not self.caching or retention is None:
            return ()
        b = self.block_size
        out = []
        for k in range(tokens.start // b + 1, min(tokens.end // b, len(hashes)) + 1):
            if retention.keeps(k) and self.pool.lookup(hashes[k - 1]) is None:
                out.append((k * b, hashes[k - 1]))
        return tuple(out)

    def apply(self, request_id: str, plan: GroupPlan) -> GroupStep:
        if not (plan.append or plan.load) and plan.copy_from is None:  # a step inside one interval, or saves only
            slot = self._tables[request_id][0]
            return GroupStep(table=(slot,), mamba=MambaStepOps(state_slot=slot, copy_from=None, saves=()), load=())
        step = super().apply(request_id, plan)
        (slot,) = step.table
        if plan.copy_from is not None:
            self._copy_from[request_id] = plan.copy_from
        ops = MambaStepOps(state_slot=slot, copy_from=plan.copy_from, saves=())
        return GroupStep(table=step.table, mamba=ops, load=tuple((0, slot) for _ in plan.load))

    def add_saves(self, request_id: str, plan: GroupPlan, step: GroupStep) -> GroupStep:
        """Slots for the plan's saves, as many as are free beyond the running slots owed to this step's admissions."""
        if not plan.saves:
            return step
        pending = self._saves.setdefault(request_id, [])
        owed = max(0, self._owed - (len(self._tables) - self._tables_before))
        wanted = plan.saves[: max(0, self.pool.available(best_effort=True) - owed)]
        slots = self.pool.allocate(len(wanted), best_effort=True)
        pending.extend((n, s, h) for (n, h), s in zip(wanted, slots))
        assert step.mamba is not None
        saves = tuple((n, s) for (n, _), s in zip(wanted, slots))
        return GroupStep(table=step.table, mamba=MambaStepOps(state_slot=step.mamba.state_slot,
                                                              copy_from=step.mamba.copy_from, saves=saves),
                         load=step.load)

    def expect_admissions(self, n: int) -> None:
        """Up to `n` more requests may get a running slot in this step: until they have, saves leave that many
        slots free (a save is best effort, an admission is not; between steps saved states are evictable)."""
        self._owed, self._tables_before = n, len(self._tables)

    def quiet(self, request_id: str, start: int, end: int) -> bool:
        """No interval boundary in (start, end] (so no save), no hit slot held and no save pending."""
        b = self.block_size
        return (
            request_id in self._tables and (not self.caching or end // b == start // b)
            and request_id not in self._copy_from and not self._saves.get(request_id)
        )

    def quiet_ops(self, request_id: str) -> MambaStepOps:
        """The ops of a quiet step: the running slot, nothing to copy or save."""
        return MambaStepOps(state_slot=self._tables[request_id][0], copy_from=None, saves=())

    def commit(self, request_id: str, num_computed: int, hashes: Sequence[BlockHash]) -> list[int]:
        """Saved states at or below num_computed become cached (hash, then release); the hit slot is released.
        Returns the chain indices (prefix of (i+1)*interval tokens) whose state became a hit."""
        copied = self._copy_from.pop(request_id, None)
        if copied is not None:
            self.pool.free((copied,))
        pending = self._saves.get(request_id, [])
        done = [(n, s, h) for n, s, h in pending if n <= num_computed]
        self._saves[request_id] = [p for p in pending if p[0] > num_computed]
        stored = []
        for n, slot, h in done:
            if self.caching and self.pool.cache(slot, h):
                stored.append(n // self.block_size - 1)
        self.pool.free(s for _, s, _ in done)
        return stored

    def free(self, request_id: str) -> None:
        self._retention.pop(request_id, None)
        copied = self._copy_from.pop(request_id, None)
        pending = self._saves.pop(request_id, [])
        self.pool.free(s for _, s, _ in pending)
        if copied is not None:
            self.pool.free((copied,))
        super().free(request_id)

    def owned(self) -> Counter[int]:
        refs = super().owned()
        refs.update(self._copy_from.values())
        refs.update(s for pending in self._saves.values() for _, s, _ in pending)
        return refs
