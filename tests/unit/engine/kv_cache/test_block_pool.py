from collections import Counter

import pytest

from hybridpd.engine.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool, KVCacheInvariantError
from hybridpd.engine.kv_cache.hashing import hash_block


def h(i: int):
    return hash_block(None, (i,))


def test_null_block_is_never_allocated():
    pool = BlockPool(4)
    got = pool.allocate(3)
    assert NULL_BLOCK_ID not in got and sorted(got) == [1, 2, 3]
    assert pool.num_free == 0
    with pytest.raises(ValueError):
        pool.allocate(1)


@pytest.mark.parametrize("cached, free_order, expected_evictions", [
    # cached blocks are evicted least recently freed first
    ([1, 2, 3], [1, 2, 3], [1, 2, 3]),
    ([1, 2, 3], [3, 1, 2], [3, 1, 2]),
    # uncached free blocks are reused before any cached one (most recently freed first)
    ([2], [1, 2, 3], [3, 1, 2]),
    ([1, 3], [1, 2, 3], [2, 1, 3]),
    ([], [3, 2, 1], [1, 2, 3]),
])
def test_eviction_order(cached, free_order, expected_evictions):
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert blocks == [1, 2, 3]
    for b in cached:
        assert pool.cache(b, h(b))
    pool.free(free_order)
    order = [pool.allocate(1)[0] for _ in range(3)]
    assert order == expected_evictions
    assert pool.num_cached == 0  # every evicted block lost its hash
    for b in cached:
        assert pool.lookup(h(b)) is None


def test_touch_takes_a_cached_block_back_and_refcounts():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(b, h(7))
    pool.free([b])
    assert pool.num_free == 2 and pool.lookup(h(7)) == b
    pool.touch([b])
    pool.touch([b])
    assert pool.ref_count(b) == 2 and pool.num_free == 1
    pool.free([b])
    assert pool.num_free == 1 and pool.ref_count(b) == 1
    pool.check_invariants(Counter({b: 1}))
    pool.free([b])
    pool.check_invariants(Counter())
    assert pool.lookup(h(7)) == b


def test_duplicate_hash_is_not_registered_twice():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache(a, h(1))
    assert not pool.cache(b, h(1))
    assert pool.lookup(h(1)) == a and pool.block_hash(b) is None


@pytest.mark.parametrize("owners, consistent", [
    (Counter({1: 1}), True),
    (Counter(), False),           # a leak: held, nobody owns it
    (Counter({1: 2}), False),     # shared without the refcount
    (Counter({1: 1, 2: 1}), False),
])
def test_check_invariants_compares_refcounts_with_owners(owners, consistent):
    pool = BlockPool(3)
    pool.allocate(1)
    if consistent:
        pool.check_invariants(owners)
    else:
        with pytest.raises(KVCacheInvariantError):
            pool.check_invariants(owners)


def test_double_free_and_null_block():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.free([b, NULL_BLOCK_ID])
    with pytest.raises(KVCacheInvariantError):
        pool.free([b])
    pool.check_invariants(Counter())


def test_reset_cache_forgets_free_blocks_only():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, h(1))
    pool.cache(b, h(2))
    pool.free([a])
    pool.reset_cache()
    assert pool.lookup(h(1)) is None and pool.lookup(h(2)) == b
    pool.check_invariants(Counter({b: 1}))


def test_too_small_pool_is_rejected():
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)
