import pytest

from .builders import Req, all_free, fa, manager, prefill

A = list(range(100, 116))          # a 16-token prompt that gets cached first
OTHER = list(range(500, 520))


@pytest.mark.parametrize("block_size, query, expected_hit", [
    (4, A, 12),                     # never the whole prompt: at least one token is computed
    (1, A, 15),
    (4, A + [1, 2, 3, 4], 16),
    (4, A[:10] + OTHER[:10], 8),    # only whole shared blocks hit
    (4, A[:3] + OTHER, 0),
    (4, OTHER, 0),
    (16, A + [1], 16),
    (16, A, 0),
])
def test_full_attention_hit_is_the_cached_run_from_the_left(block_size, query, expected_hit):
    m = manager(fa(block_size))
    prefill(m, Req("a", list(A)))
    m.free("a")
    req = Req("q", list(query))
    hit = m.get_computed_blocks(req)
    assert hit.num_tokens == expected_hit
    assert len(hit.blocks[0]) == expected_hit // block_size
    step = m.allocate_slots(req, len(query) - hit.num_tokens, hit)
    assert step.block_tables[0][: len(hit.blocks[0])] == hit.blocks[0]
    assert len(step.block_tables[0]) == -(-len(query) // block_size)
    m.check_invariants()
    m.free("q")
    m.check_invariants()
    assert all_free(m)


def test_shared_prefix_blocks_are_refcounted():
    m = manager(fa(4), blocks=20)
    prefill(m, Req("a", A + [1, 2, 3, 4]))               # holds 5 blocks
    b = Req("b", A + [7, 7, 7, 7])
    hit = m.get_computed_blocks(b)
    assert hit.num_tokens == 16
    step = m.allocate_slots(b, 4, hit)
    assert step.block_tables[0][:4] == m.block_table("a")[0][:4]
    assert m.num_free_blocks(0) == 19 - 5 - 1              # the 4 shared blocks are counted once
    m.check_invariants()                                    # refcount 2 == two owners
    m.free("a")
    assert m.num_free_blocks(0) == 19 - 5                   # a's tail block only; shared ones still held by b
    m.check_invariants()
    m.free("b")
    m.free("b")                                             # idempotent
    m.check_invariants()
    assert all_free(m)


def test_least_recently_freed_prefix_is_evicted_first():
    m = manager(fa(4), blocks=9)                            # 8 usable blocks: room for two 16-token prompts
    prefill(m, Req("a", list(A)))
    prefill(m, Req("b", list(OTHER[:16])))
    m.free("a")
    m.free("b")
    prefill(m, Req("c", list(range(900, 916))))             # needs 4 blocks: evicts a's, not b's
    m.free("c")
    assert m.get_computed_blocks(Req("qa", A + [0])).num_tokens == 0
    assert m.get_computed_blocks(Req("qb", OTHER[:16] + [0])).num_tokens == 16
    m.check_invariants()


def test_salt_separates_caches():
    m = manager(fa(4))
    prefill(m, Req("a", list(A), cache_salt=b"tenant-1"))
    m.free("a")
    assert m.get_computed_blocks(Req("b", A + [0], cache_salt=b"tenant-2")).num_tokens == 0
    assert m.get_computed_blocks(Req("c", A + [0], cache_salt=b"tenant-1")).num_tokens == 16


def test_caching_off_never_hits_and_frees_everything():
    m = manager(fa(4), caching=False)
    prefill(m, Req("a", list(A)))
    m.free("a")
    assert m.get_computed_blocks(Req("b", A + [0])).num_tokens == 0
    assert m.stats()[0].num_cached == 0
    assert all_free(m)
