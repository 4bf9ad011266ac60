"""Pools that share one byte budget: where a new block comes from, what a best-effort allocation may take, and
`PageBudget.fits` against a brute force (allocating the demands one block at a time)."""

import copy
import mmap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpd.config import CacheConfig
from hybridpd.engine.kv_cache.block_pool import BlockPool
from hybridpd.engine.kv_cache.budget import PageBudget
from hybridpd.engine.kv_cache.coordinator import KVCacheManager
from hybridpd.engine.kv_cache.hashing import hash_block
from hybridpd.engine.kv_cache.memory import SharedMemory
from hybridpd.engine.kv_cache.spec import KVCacheGroup, MambaSpec
from hybridpd.engine.kv_cache.storage import KVCacheStorage

from .builders import Req, all_free, fa, groups_of, mamba


def h(i: int):
    return hash_block(None, (i,))


class Log:
    def __init__(self):
        self.removed, self.released = [], []

    def pool(self, name, budget, page, n, cap=None):
        return BlockPool(n, lambda bh: self.removed.append((name, bh)), budget=budget, page_bytes=page,
                         on_released=lambda b: self.released.append((name, b)), cached_cap=cap)


def test_a_new_block_comes_from_own_uncached_then_unused_bytes_then_others_uncached_then_the_shared_lru():
    log, budget = Log(), PageBudget(60)
    a, b = log.pool("a", budget, 10, 8), log.pool("b", budget, 20, 4)
    assert a.allocate(3) == [1, 2, 3] and budget.used == 30
    a.cache(1, h(1))
    a.free([1, 2, 3])
    assert b.allocate(1) == [1] and budget.used == 50                 # unused bytes
    b.cache(1, h(11))
    assert b.allocate(1) == [2]                                       # a's first uncached block paid the rest
    assert log.released == [("a", 3)] and not log.removed and budget.used == 60
    b.free([2, 1])
    assert a.allocate(1) == [2]                                       # its own uncached block first
    assert a.allocate(1) == [3] and log.released[-1] == ("b", 2)      # b's uncached block before its own cached one
    assert a.lookup(h(1)) == 1 and budget.room == 10
    assert a.allocate(1) == [4] and a.lookup(h(1)) == 1               # unused bytes before its own cached block
    assert a.allocate(1) == [1] and log.removed == [("a", h(1))]      # the least recently freed: its own
    assert a.allocate(1) == [5] and log.removed[-1] == ("b", h(11)) and log.released[-1] == ("b", 1)
    assert a.num_free == 1 and b.num_free == 0
    with pytest.raises(ValueError):
        a.allocate(2)
    assert budget.used == 50 and a.num_held == 5 and b.num_held == 0 and b.num_spare == 3


def test_a_best_effort_block_takes_another_pools_cached_block_only_below_the_cap():
    log, budget = Log(), PageBudget(30)
    attention, states = log.pool("attention", budget, 10, 5), log.pool("states", budget, 10, 5, cap=1)
    attention.allocate(2)
    for block in (1, 2):
        attention.cache(block, h(block))
    attention.free([1, 2])
    assert states.available(best_effort=True) == 3                  # below the cap: unused bytes and attention's
    (saved,) = states.allocate(1, best_effort=True)
    assert not log.released                                         # unused bytes first
    states.cache(saved, h(100))
    states.free([saved])
    assert states.available(best_effort=True) == 1 and states.num_free == 3   # at the cap: only its own
    assert states.allocate(1, best_effort=True) == [saved] and not log.released   # replaced, attention untouched
    assert attention.num_cached == 2
    assert states.allocate(2) and log.released == [("attention", 1), ("attention", 2)]   # a required one may


def test_the_least_recently_freed_cached_block_of_any_pool_goes_first():
    log, budget = Log(), PageBudget(40)
    a, b = log.pool("a", budget, 10, 5), log.pool("b", budget, 20, 3)
    assert a.allocate(2) == [1, 2] and b.allocate(1) == [1]
    a.cache(1, h(1))
    a.cache(2, h(2))
    b.cache(1, h(11))
    a.free([1])
    b.free([1])
    a.free([2])                                  # freed: a's 1, then b's 1, then a's 2
    assert a.allocate(1) == [1] and log.removed == [("a", h(1))]
    assert a.allocate(1) == [3] and log.removed[-1] == ("b", h(11)) and log.released == [("b", 1)]
    assert a.allocate(1) == [4] and a.lookup(h(2)) == 2           # b's 20 bytes paid for two of a's blocks
    assert a.allocate(1) == [2] and log.removed[-1] == ("a", h(2))


def test_the_pages_of_a_block_given_back_are_released_and_it_reads_as_zeros_when_reused():
    spec = MambaSpec(block_size=8, conv_state_shape=(4, 256), ssm_state_shape=(4, 1024),
                     dtypes=(torch.float32, torch.float32))          # 20 KiB: pages wholly inside each block
    storage = KVCacheStorage((KVCacheGroup(spec=spec, layer_ids=(0,)),), (4,))
    page = spec.page_size_bytes
    storage.tensors[0].fill_(7)
    storage.release(0, 2)
    block = storage.tensors[0][2]
    zero = block == 0
    start = -(-2 * page // mmap.PAGESIZE) * mmap.PAGESIZE - 2 * page   # the block's first whole page ...
    end = 3 * page // mmap.PAGESIZE * mmap.PAGESIZE - 2 * page          # ... and the end of its last
    assert zero[start:end].all() and not zero[:start].any() and not zero[end:].any()
    assert (storage.tensors[0][1] == 7).all() and (storage.tensors[0][3] == 7).all()


@st.composite
def histories(draw):
    pages = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    capacity = draw(st.integers(max(pages), 40))
    ops = draw(st.lists(st.tuples(st.sampled_from(["alloc", "cache", "free"]), st.integers(0, len(pages) - 1),
                                  st.integers(1, 4)), max_size=30))
    demands = draw(st.lists(st.integers(0, 6), min_size=len(pages), max_size=len(pages)))
    return pages, capacity, ops, demands


@settings(max_examples=300, deadline=None)
@given(histories())
def test_fits_says_exactly_whether_every_demand_can_be_allocated(history):
    pages, capacity, ops, demands = history
    budget = PageBudget(capacity)
    pools = [BlockPool(1 + capacity // p, budget=budget, page_bytes=p) for p in pages]
    held = [[] for _ in pools]
    serial = iter(range(10**6))
    for op, i, n in ops:
        pool = pools[i]
        if op == "alloc" and pool.num_free >= n:
            held[i].extend(pool.allocate(n))
        elif op == "cache" and held[i]:
            pool.cache(held[i][0], h(next(serial)))
        elif op == "free" and held[i]:
            pool.free(held[i][:n])
            del held[i][:n]
    trial = copy.deepcopy(budget)
    possible = True
    for pool, need in zip(trial.pools, demands):   # one block at a time, the pools in turn
        for _ in range(need):
            if pool.num_free < 1:
                possible = False
                break
            pool.allocate(1)
        if not possible:
            break
    assert budget.fits(dict(zip(pools, demands))) == possible
    assert budget.used <= capacity and trial.used <= capacity


@pytest.mark.parametrize("capacity, second_admitted, first_grows", [
    (736, None, False),               # one request of 8 tokens (two attention blocks, one Mamba slot), nothing more
    (2 * 736 + 255, False, True),     # room for the second, not for the first's next block beside it
    (2 * 736 + 256, True, True),
])
def test_a_request_is_admitted_only_if_the_running_ones_can_still_grow_by_a_block(capacity, second_admitted,
                                                                                  first_grows):
    groups = groups_of(fa(4), mamba(8))
    assert [g.page_size_bytes for g in groups] == [256, 224]
    ids = tuple(1 + capacity // g.page_size_bytes for g in groups)
    kv = KVCacheManager(groups, ids, CacheConfig(block_size=4, enable_prefix_caching=False),
                        shared=SharedMemory(capacity=capacity, mamba_cached_cap=0))
    first, second = Req("a", list(range(8))), Req("b", list(range(8, 16)))
    assert kv.allocate_slots(first, 8, kv.get_computed_blocks(first)) is not None   # alone: it only has to fit
    kv.commit(first, 8)
    if second_admitted is not None:
        assert (kv.allocate_slots(second, 8, kv.get_computed_blocks(second)) is not None) == second_admitted
    assert (kv.allocate_slots(first, 1) is not None) == first_grows                # the running one grows
    kv.check_invariants()
    kv.free("a")
    kv.free("b")
    assert all_free(kv)
