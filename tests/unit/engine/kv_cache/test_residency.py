"""vLLM's sampled KV cache residency metrics (engine/kv_cache/residency.py) through a real block pool: a followed
block's lifetime, idle time and reuse gaps when its memory goes to another block (allocated again, or handed back to
a shared budget), none for a block not sampled, nothing after a reset, and the sample share checked."""

from __future__ import annotations

import random

import pytest

from hybridpd.engine.kv_cache.block_pool import BlockPool
from hybridpd.engine.kv_cache.budget import PageBudget
from hybridpd.engine.kv_cache.residency import ACCESSES_KEPT, BlockResidency


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def observed(snapshot) -> tuple[int, float]:
    return snapshot.count, round(snapshot.total, 6)


@pytest.fixture
def followed():
    clock = Clock()
    residency = BlockResidency(1.0, clock=clock)
    return clock, residency, BlockPool(3, residency=residency.for_pool(0))   # blocks 1 and 2


def test_a_reused_block_reports_its_lifetime_idle_time_and_reuse_gaps(followed):
    clock, residency, pool = followed
    (block,) = pool.allocate(1)
    pool.cache(block, b"h")
    pool.free([block])
    for at in (101.0, 103.0, 107.0):   # three prefix hits, each taking and dropping the block
        clock.now = at
        pool.touch([block])
        pool.free([block])
    clock.now = 110.0
    pool.allocate(2)                   # the uncached block 2 first, then block 1, its hash evicted
    snapshot = residency.snapshot()
    assert observed(snapshot.lifetime) == (1, 10.0)
    assert observed(snapshot.idle_before_evict) == (1, 3.0)
    assert observed(snapshot.reuse_gap) == (2, 6.0)   # 101 -> 103 -> 107


def test_only_the_last_accesses_are_kept_for_the_gaps(followed):
    clock, residency, pool = followed
    (block,) = pool.allocate(1)
    for step in range(ACCESSES_KEPT + 3):
        clock.now += 1 + step
        pool.touch([block])
    pool.free([block] * (ACCESSES_KEPT + 4))
    pool.allocate(2)
    assert residency.snapshot().reuse_gap.count == ACCESSES_KEPT - 1


def test_memory_handed_back_to_a_shared_budget_ends_a_block():
    clock = Clock()
    residency = BlockResidency(1.0, clock=clock)
    budget = PageBudget(20)   # room for two pages of 10 bytes between the two pools
    a = BlockPool(4, budget=budget, page_bytes=10, residency=residency.for_pool(0))
    b = BlockPool(4, budget=budget, page_bytes=10, residency=residency.for_pool(1))
    a.free(a.allocate(2))
    clock.now += 4
    b.allocate(1)                     # a hands one block's memory back: it ends there
    assert observed(residency.snapshot().lifetime) == (1, 4.0)


def test_a_reset_of_the_prefix_cache_forgets_every_followed_block(followed):
    clock, residency, pool = followed
    pool.free(pool.allocate(2))
    residency.reset()
    pool.allocate(2)
    assert residency.snapshot().lifetime.count == 0


def test_blocks_not_sampled_report_nothing():
    residency = BlockResidency(0.25, rng=random.Random(3))
    pool = BlockPool(401, residency=residency.for_pool(0))
    blocks = pool.allocate(400)
    pool.free(blocks)
    pool.allocate(400)
    assert 60 < residency.snapshot().lifetime.count < 140   # ~100 of 400 followed


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_a_sample_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match="--kv-cache-metrics-sample"):
        BlockResidency(share)
