"""`KVCacheManager`: the facade the engine uses over per-group pools and per-kind managers.

Per request, the engine calls `get_computed_blocks` once at admission, `allocate_slots` every step it schedules
the request (the first call with the hit, and with the tokens that arrive from a connector), `commit` after
every step, and `free` when the request finishes, aborts, fails or is preempted. With
`config.enable_kv_cache_events`, every change of the set of hits is recorded in order (`take_events`), for the
node's KV event publisher. With a storage tier (`use_storage`), `storage_hit` extends a memory hit over what the tier
holds, `storage_sources` names the blocks to read for it, and `take_new_cached` lists the blocks that became hits
since the last call (for the tier's write-behind).

With `shared` memory (memory.py's sizing from one budget), the groups' pools draw from one `PageBudget` instead of
holding fixed block counts (budget.py): a step fits when the budget covers every group's new blocks together.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridpd.config import CacheConfig, MambaCacheMode
from hybridpd.engine.kv_cache.block_pool import BlockPool, KVCacheInvariantError
from hybridpd.engine.kv_cache.budget import PageBudget
from hybridpd.engine.kv_cache.cache_types import CacheHit, CacheRequest, GroupStats, MambaStepOps, StepBlocks
from hybridpd.engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from hybridpd.engine.kv_cache.hashing import BlockHash, RequestBlockHashes
from hybridpd.engine.kv_cache.hit_search import find_common_hit
from hybridpd.engine.kv_cache.offload_hits import StorageIndex, WithStorage
from hybridpd.engine.kv_cache.mamba import MambaManager
from hybridpd.engine.kv_cache.managers import make_manager
from hybridpd.engine.kv_cache.memory import SharedMemory
from hybridpd.engine.kv_cache.residency import BlockResidency
from hybridpd.engine.kv_cache.single_type import TokenRange
from hybridpd.engine.kv_cache.spec import KVCacheGroup, MambaSpec
from hybridpd.engine.kv_cache.validation import validate_layout

__all__ = ["CacheHit", "CacheRequest", "GroupStats", "KVCacheManager", "MambaStepOps", "StepBlocks"]


class KVCacheManager:
    def __init__(self, groups: tuple[KVCacheGroup, ...], num_blocks: tuple[int, ...], config: CacheConfig, *,
                 shared: SharedMemory | None = None, on_release: Callable[[int, int], None] | None = None) -> None:
        """`on_release(group, block)`: a shared pool gave the block's memory back (the storage returns its pages)."""
        validate_layout(groups, num_blocks, config)
        self.groups = groups
        self.config = config
        self.caching = config.enable_prefix_caching
        self._events: list[KVCacheEvent] | None = [] if config.enable_kv_cache_events else None
        self._budget = PageBudget(shared.capacity) if shared is not None else None
        sample = config.kv_cache_metrics_sample
        self.residency = BlockResidency(sample) if sample is not None else None   # --kv-cache-metrics
        self._growth_bytes = sum(g.page_size_bytes for g in groups if not isinstance(g.spec, MambaSpec))
        self._pools = tuple(self._pool(g, n, shared, on_release) for g, n in enumerate(num_blocks))
        self._managers = tuple(
            make_manager(g.spec, pool, caching=self.caching and self._group_caches(g), config=config)
            for g, pool in zip(groups, self._pools)
        )
        self._block_sizes = tuple(sorted({m.block_size for m in self._managers}))  # one hash chain per size
        order = sorted(range(len(groups)), key=lambda i: self._managers[i].search_order)
        self._all_groups = tuple(order)
        self._remote_groups = tuple(i for i in order if self._managers[i].decides_remote_hit)
        self._hashes: dict[str, RequestBlockHashes] = {}
        self._next_start: dict[str, int] = {}   # where the next call's new tokens start, per known request
        # Quiet steps (no group allocates, caches, saves or releases anything: most decode steps) skip the
        # per-group plans. `_quiet_blocks`: the StepBlocks such a step returns, valid until the next step that is
        # not quiet; `_quiet_end`: the commit point of an allocated quiet step, whose commit is then a no-op.
        self._quiet_blocks: dict[str, StepBlocks] = {}
        self._quiet_end: dict[str, int] = {}
        self._storage: StorageIndex | None = None
        self._new_cached: list[tuple[int, BlockHash, int]] = []   # (group, hash, block id), with a storage tier
        self._queries = [0] * len(groups)
        self._query_tokens = [0] * len(groups)
        self._hit_tokens = [0] * len(groups)

    def upcoming_blocks(self, n: int) -> tuple[list[int], ...]:
        """Per group, up to n blocks the next allocations will take whose memory may not be written yet
        (`BlockPool.upcoming`): what the storage faults in ahead."""
        return tuple(pool.upcoming(n) for pool in self._pools)

    def _pool(self, g: int, n: int, shared: SharedMemory | None,
              on_release: Callable[[int, int], None] | None) -> BlockPool:
        residency = self.residency.for_pool(g) if self.residency is not None else None
        if shared is None:
            return BlockPool(n, self._removal_recorder(g), residency=residency)
        cap = shared.mamba_cached_cap if isinstance(self.groups[g].spec, MambaSpec) else None
        release = (lambda block: on_release(g, block)) if on_release is not None else None
        return BlockPool(n, self._removal_recorder(g), budget=self._budget, page_bytes=self.groups[g].page_size_bytes,
                         on_released=release, cached_cap=cap, residency=residency)

    def _removal_recorder(self, group_idx: int):
        events = self._events
        if events is None:
            return None
        return lambda block_hash: events.append(BlockRemoved(group_idx=group_idx, block_hashes=(block_hash,)))

    def _record_stored(self, req: CacheRequest, group_idx: int, chain: list[BlockHash], stored: list[int]) -> None:
        """One BlockStored per run of consecutive chain indices that became hits."""
        assert self._events is not None
        size = self._managers[group_idx].block_size
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self._events.append(BlockStored(
                group_idx=group_idx, block_hashes=tuple(chain[first : last + 1]),
                parent_block_hash=chain[first - 1] if first else None,
                token_ids=tuple(req.all_token_ids[first * size : (last + 1) * size]), block_size=size,
            ))

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (always empty without enable_kv_cache_events)."""
        if not self._events:
            return []
        events = list(self._events)
        self._events.clear()
        return events

    def _group_caches(self, group: KVCacheGroup) -> bool:
        return not isinstance(group.spec, MambaSpec) or self.config.mamba_cache_mode is MambaCacheMode.ALIGN

    def _chains(self, req: CacheRequest) -> list[list[BlockHash]]:
        if not self.caching:
            return [[] for _ in self._managers]
        store = self._hashes.get(req.request_id)
        if store is None:
            store = self._hashes[req.request_id] = RequestBlockHashes(req.cache_salt)
        by_size = {size: store.chain(size, req.all_token_ids) for size in self._block_sizes}
        return [by_size[m.block_size] for m in self._managers]

    # --- the request lifecycle ---
    def no_hit(self) -> CacheHit:
        """The hit of a request that computes its whole prompt."""
        return CacheHit(num_tokens=0, blocks=tuple(() for _ in self.groups))

    def get_computed_blocks(self, req: CacheRequest) -> CacheHit:
        """The longest local prefix hit: < num_prompt_tokens, decided by every group, or only by the
        full-attention groups when `req.skip_mamba_align` (0 if there is none)."""
        n_prompt = req.num_prompt_tokens
        if not self.caching or n_prompt <= 1:
            return self.no_hit()
        blocks: list[tuple[int, ...]] = [() for _ in self.groups]
        deciding = self._remote_groups if req.skip_mamba_align else self._all_groups
        chains = self._chains(req)
        hit = find_common_hit([self._managers[g] for g in deciding], [chains[g] for g in deciding], n_prompt - 1)
        if hit:
            for g in deciding:
                blocks[g] = self._managers[g].hit_blocks(chains[g], hit)
        shared = hit
        if deciding != self._remote_groups and self._remote_groups:  # where Mamba states are saved (retention.py)
            shared = find_common_hit([self._managers[g] for g in self._remote_groups],
                                     [chains[g] for g in self._remote_groups], n_prompt - 1)
        return CacheHit(num_tokens=hit, blocks=tuple(blocks), shared_tokens=shared)

    # --- the storage tier ---
    def use_storage(self, storage: StorageIndex) -> None:
        self._storage = storage

    def storage_hit(self, req: CacheRequest, hit: CacheHit, at_most: int | None = None) -> int:
        """The longest prefix < num_prompt_tokens (and <= `at_most`) that the deciding groups (every group, or the
        full-attention ones under `skip_mamba_align`, as for the memory hit) serve from memory and storage together,
        if it is longer than the memory `hit` (else 0)."""
        if self._storage is None or self._storage.empty or not self.caching or req.num_prompt_tokens <= 1:
            return 0
        deciding = self._remote_groups if req.skip_mamba_align else self._all_groups
        chains = self._chains(req)
        union = [WithStorage(self._managers[g], g, self._storage.has) for g in deciding]
        limit = req.num_prompt_tokens - 1 if at_most is None else min(req.num_prompt_tokens - 1, at_most)
        found = find_common_hit(union, [chains[g] for g in deciding], limit)
        return found if found > hit.num_tokens else 0

    def storage_sources(self, req: CacheRequest, blocks: StepBlocks, num_tokens: int) -> list[tuple[int, int, BlockHash]]:
        """(group, block id, hash) of the blocks of `blocks.load` that a storage hit of `num_tokens` brings: those of
        the deciding groups that carry tokens [0, num_tokens) (the rest, if any, a remote pull brings)."""
        chains = self._chains(req)
        deciding = self._remote_groups if req.skip_mamba_align else self._all_groups
        sources = []
        for g in deciding:
            spec, end = self.groups[g].spec, self.groups[g].spec.needed_span(num_tokens)[1]
            sources.extend((g, block_id, chains[g][spec.hash_index(logical, num_tokens)])
                           for logical, block_id in blocks.load[g] if logical < end)
        return sources

    def take_new_cached(self) -> list[tuple[int, BlockHash, int]]:
        """(group, hash, block id) of each block that became a hit since the last call (with a storage tier)."""
        new, self._new_cached = self._new_cached, []
        return new

    def _count_lookup(self, req: CacheRequest, hit: CacheHit) -> None:
        """Prefix-cache statistics, once per request: at its first allocation, with the hit it takes. (A request
        at the head of the queue that does not fit yet is looked up again at every step; counting those lookups
        would inflate the query count and understate the hit rate.)"""
        for g, blocks in enumerate(hit.blocks):
            self._queries[g] += 1
            self._query_tokens[g] += req.num_prompt_tokens
            if blocks:
                self._hit_tokens[g] += hit.num_tokens

    def allocate_slots(self, req: CacheRequest, num_new_tokens: int, hit: CacheHit | None = None,
                       num_external_tokens: int = 0, remote: bool = False) -> StepBlocks | None:
        """Blocks for [0, start + num_new_tokens); None (and nothing changed) if some group lacks free blocks.

        The first call of a request takes references on `hit`'s blocks; its new tokens start after the hit and
        the `num_external_tokens` that arrive from a connector. For a remotely filled request (`remote`: its
        prompt was prefilled elsewhere, even when the local hit leaves no token to pull) that call also says which
        blocks to `load`; its Mamba state always comes from the connector, since no compute step runs before the
        loader hands the request back. Later calls pass only new tokens, which start at the last committed count.
        """
        rid = req.request_id
        if num_new_tokens < 0 or num_external_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got new={num_new_tokens}, external={num_external_tokens}")
        first = rid not in self._next_start
        if first:
            hit = hit if hit is not None else CacheHit(num_tokens=0, blocks=tuple(() for _ in self.groups))
            if len(hit.blocks) != len(self.groups):
                raise ValueError(f"a CacheHit for {len(hit.blocks)} groups, the cache has {len(self.groups)}")
            start = hit.num_tokens + num_external_tokens
            tokens = TokenRange(first=True, hit=hit.num_tokens, start=start, end=start + num_new_tokens,
                                external=remote or num_external_tokens > 0 or req.skip_mamba_align,
                                num_prompt=req.num_prompt_tokens, shared=max(hit.shared_tokens, hit.num_tokens))
        else:
            if hit is not None or num_external_tokens:
                raise ValueError(f"request {rid} already holds blocks: only its first allocate_slots takes a hit "
                                 "or external tokens")
            start = self._next_start[rid]
            end = start + num_new_tokens
            if num_new_tokens and all(m.quiet(rid, start, end) for m in self._managers):
                self._quiet_end[rid] = end
                return self._quiet_step_blocks(rid)
            tokens = TokenRange(first=False, hit=0, start=start, end=end, external=False)
        chains = self._chains(req)
        hit_blocks = hit.blocks if first and hit is not None else ((),) * len(self._managers)
        plans = [m.plan(rid, hit_blocks[g], tokens, chains[g]) for g, m in enumerate(self._managers)]
        if not self._fits(plans, admitting=first):
            return None
        for p, pool in zip(plans, self._pools):   # every group's hit first: no group's allocation may evict it
            pool.touch(p.touched)
        steps = [m.apply(rid, p) for m, p in zip(self._managers, plans)]
        steps = [m.add_saves(rid, p, s) for m, p, s in zip(self._managers, plans, steps)]   # best effort, last
        self._next_start[rid] = start
        self._forget_quiet(rid)
        if first:
            self._count_lookup(req, hit)
        return StepBlocks(
            block_tables=tuple([s.table for s in steps]),
            mamba=tuple([s.mamba for s in steps]),
            load=tuple([s.load for s in steps]),
        )

    def commit(self, req: CacheRequest, num_computed_tokens: int) -> None:
        """After a step: cache newly full blocks and Mamba saves, release window blocks nobody can see again."""
        rid = req.request_id
        if rid not in self._next_start:
            return
        if self._quiet_end.pop(rid, None) != num_computed_tokens:  # else: the quiet step's commit, a no-op
            chains = self._chains(req)
            for g, (m, hashes) in enumerate(zip(self._managers, chains)):
                stored = m.commit(rid, num_computed_tokens, hashes)
                if stored and self._events is not None:
                    self._record_stored(req, g, hashes, stored)
                if stored and self._storage is not None:
                    pool = self._pools[g]
                    self._new_cached.extend((g, hashes[i], pool.lookup(hashes[i])) for i in stored)
            self._quiet_blocks.pop(rid, None)
        self._next_start[rid] = max(self._next_start[rid], num_computed_tokens)

    def _fits(self, plans: list, *, admitting: bool) -> bool:
        """Does the step fit? On a shared budget a request is admitted only if every request already holding blocks
        could still take one more block in each attention group after it: otherwise the next blocks the running
        requests grow into would preempt one of them, and the freed bytes would admit the same request again."""
        if self._budget is None:
            return all(p.free_blocks_needed(pool) <= pool.num_free for p, pool in zip(plans, self._pools))
        reserve = len(self._next_start) * self._growth_bytes if admitting else 0
        return self._budget.fits({pool: p.free_blocks_needed(pool) for p, pool in zip(plans, self._pools)}, reserve)

    def _quiet_step_blocks(self, rid: str) -> StepBlocks:
        blocks = self._quiet_blocks.get(rid)
        if blocks is None:
            blocks = self._quiet_blocks[rid] = StepBlocks(
                block_tables=tuple([m.table(rid) for m in self._managers]),
                mamba=tuple([m.quiet_ops(rid) for m in self._managers]),
                load=((),) * len(self._managers),
            )
        return blocks

    def _forget_quiet(self, rid: str) -> None:
        self._quiet_blocks.pop(rid, None)
        self._quiet_end.pop(rid, None)

    def expect_admissions(self, n: int) -> None:
        """Up to `n` waiting requests may be admitted in the coming step: until they are, Mamba saves leave their
        running slots free (the scheduler says so at the start of every step)."""
        for m in self._managers:
            if isinstance(m, MambaManager):
                m.expect_admissions(n)

    def free(self, request_id: str) -> None:
        """Everything the request holds back to the pools (cached blocks keep their hashes). Idempotent."""
        for m in self._managers:
            m.free(request_id)
        self._hashes.pop(request_id, None)
        self._next_start.pop(request_id, None)
        self._forget_quiet(request_id)

    # --- views ---
    def block_table(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        return tuple(m.table(request_id) for m in self._managers)

    def num_free_blocks(self, group_id: int) -> int:
        return self._pools[group_id].num_free

    def num_blocks(self, group_id: int) -> int:
        return self._pools[group_id].num_blocks

    def cached_block(self, group_id: int, block_hash: BlockHash) -> int | None:
        """The block of group `group_id` cached under `block_hash`, if any (read-only; tests and tooling)."""
        return self._pools[group_id].lookup(block_hash)

    def cached_hashes(self, group_id: int) -> frozenset[BlockHash]:
        """Every hash group `group_id` can serve a hit from (read-only; tests and tooling)."""
        return self._pools[group_id].cached_hashes()

    def usage(self) -> float:
        """The share of the cache that requests hold (shared memory: of the budget's bytes; else the fullest group)."""
        if self._budget is not None:
            return self._budget.held_bytes() / self._budget.capacity
        return max(1 - p.num_free / p.num_blocks for p in self._pools)

    def stats(self) -> tuple[GroupStats, ...]:
        return tuple(
            GroupStats(group_id=g, kind=group.spec.kind, queries=self._queries[g], query_tokens=self._query_tokens[g],
                       hit_tokens=self._hit_tokens[g], num_free=pool.num_free, num_total=pool.num_blocks,
                       num_cached=pool.num_cached)
            for g, (group, pool) in enumerate(zip(self.groups, self._pools))
        )

    def check_invariants(self) -> None:
        """Raises KVCacheInvariantError on any inconsistency between the pools and the requests' tables."""
        known = set(self._next_start)
        for g, (m, pool) in enumerate(zip(self._managers, self._pools)):
            stray = m.request_ids() - known
            if stray:
                raise KVCacheInvariantError(f"group {g} holds blocks for unknown requests {sorted(stray)}")
            pool.check_invariants(m.owned())
        if self._budget is not None:
            resident = sum((p.num_blocks - p.num_spare) * p.page_bytes for p in self._pools)
            if resident != self._budget.used or resident > self._budget.capacity:
                raise KVCacheInvariantError(f"the pools hold {resident} B, the budget counts {self._budget.used} B "
                                            f"of {self._budget.capacity}")

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash of a free block (blocks held by running requests keep theirs). When no hash is
        left, the removals are recorded as one AllBlocksCleared."""
        mark = len(self._events) if self._events is not None else 0
        for pool in self._pools:
            pool.reset_cache()
        if self.residency is not None:
            self.residency.reset()
        if self._events is not None and all(pool.num_cached == 0 for pool in self._pools):
            del self._events[mark:]
            self._events.append(AllBlocksCleared())
