import math

import pytest

from hybridpd.engine.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool
from hybridpd.engine.kv_cache.hashing import RequestBlockHashes
from hybridpd.engine.kv_cache.sliding_window import SlidingWindowManager

from .builders import Req, all_free, fa, manager, prefill, sw

TOKENS = list(range(1000, 1064))


def window_manager(window: int, block_size: int, cached_blocks: set[int]):
    """A window manager whose pool holds exactly the given logical blocks of TOKENS."""
    pool = BlockPool(40)
    hashes = RequestBlockHashes(None).chain(block_size, TOKENS)
    for i in sorted(cached_blocks):
        (b,) = pool.allocate(1)
        pool.cache(b, hashes[i])
        pool.free([b])
    return SlidingWindowManager(sw(window, block_size), pool, caching=True), hashes


@pytest.mark.parametrize("window, block_size, cached, max_tokens, alignment, expected", [
    (8, 4, {2, 3}, 16, 4, 16),          # L=16 needs positions [9, 16): blocks 2, 3
    (8, 4, {0, 1, 3}, 16, 4, 8),        # block 2 missing: L=16 and 12 fail, L=8 needs blocks 0, 1
    (8, 4, {3}, 16, 4, 0),
    (8, 4, {0, 1, 2, 3}, 15, 4, 12),    # capped by max_tokens, aligned down
    (8, 4, {1, 2}, 16, 4, 12),          # L=12 needs [5, 12): blocks 1, 2
    (8, 4, {1, 2}, 16, 8, 0),           # with alignment 8 only 16 and 8 are candidates: neither works
    (1, 4, set(), 16, 4, 16),           # window 1: the next query sees only itself
    (5, 4, {3}, 16, 4, 16),             # L=16 needs [12, 16): block 3 only
    (64, 4, {0, 1, 2}, 16, 4, 12),      # a window longer than the prefix needs every block
    (3, 1, {10, 11}, 12, 1, 12),
    (3, 1, {9, 10}, 12, 1, 11),         # right-to-left: L=12 needs 10, 11; L=11 needs 9, 10
    (3, 1, {9}, 12, 1, 0),
])
def test_longest_hit_needs_only_the_window(window, block_size, cached, max_tokens, alignment, expected):
    mgr, hashes = window_manager(window, block_size, cached)
    assert mgr.longest_hit(hashes, max_tokens, alignment) == expected
    if expected:
        blocks = mgr.hit_blocks(hashes, expected)
        first = max(0, expected - window + 1) // block_size
        assert blocks[:first] == (NULL_BLOCK_ID,) * first
        assert NULL_BLOCK_ID not in blocks[first:]
        assert len(blocks) == expected // block_size


@pytest.mark.parametrize("window, block_size, chunk", [(8, 4, 4), (8, 4, 7), (5, 4, 1), (1, 4, 3), (16, 2, 40)])
def test_blocks_leave_as_soon_as_they_are_out_of_the_window(window, block_size, chunk):
    m = manager(sw(window, block_size), blocks=64)
    req = Req("a", list(range(40)))
    computed = 0
    while computed < 40:
        n = min(chunk, 40 - computed)
        assert m.allocate_slots(req, n) is not None
        computed += n
        m.commit(req, computed)
        table = m.block_table("a")[0]
        first_visible = max(0, computed - window + 1) // block_size
        assert all(b == NULL_BLOCK_ID for b in table[:first_visible])
        assert all(b != NULL_BLOCK_ID for b in table[first_visible:])
        held = sum(1 for b in table if b != NULL_BLOCK_ID)
        assert held <= math.ceil((window - 1) / block_size) + 1
        m.check_invariants()
    m.free("a")
    assert all_free(m)


@pytest.mark.parametrize("window, block_size", [(4096, 16), (64, 16), (17, 16), (16, 16), (1, 16), (5, 4)])
def test_70k_external_prompt_holds_only_the_window(window, block_size):
    n = 70_000
    m = manager(fa(block_size), sw(window, block_size), blocks=(n // block_size + 8, 600))
    req = Req("r", [i % 5000 for i in range(n)], skip_mamba_align=True)
    hit = m.get_computed_blocks(req)
    assert hit.num_tokens == 0
    step = m.allocate_slots(req, 1, hit, num_external_tokens=n - 1)
    table = step.block_tables[1]
    held = [i for i, b in enumerate(table) if b != NULL_BLOCK_ID]
    assert len(table) == -(-n // block_size)
    assert len(held) <= math.ceil(window / block_size) + 1            # during the step: [N-W, N) is needed
    assert held == list(range(max(0, n - window) // block_size, len(table)))
    assert [i for i, _ in step.load[1]] == [i for i in held if i * block_size < n - 1]
    m.commit(req, n)
    after = [b for b in m.block_table("r")[1] if b != NULL_BLOCK_ID]
    assert len(after) <= math.ceil((window - 1) / block_size) + 1
    m.check_invariants()
    m.free("r")
    assert all_free(m)


def test_external_window_reuses_blocks_held_locally():
    b, window = 4, 8
    prompt = list(range(200, 224))
    m = manager(fa(b), sw(window, b))
    prefill(m, Req("local", prompt[:20]))       # caches window blocks 0..4 locally
    m.free("local")
    req = Req("remote", prompt, skip_mamba_align=True)
    hit = m.get_computed_blocks(req)
    assert hit.num_tokens == 20
    step = m.allocate_slots(req, 1, hit, num_external_tokens=3)    # tokens 20..22 remote, 23 computed here
    # the query at 23 sees [16, 23]: block 4 is cached locally, block 5 ([20, 24)) must be loaded
    assert [i for i, _ in step.load[1]] == [5]
    assert [i for i, _ in step.load[0]] == [5]
    assert step.block_tables[1][:4] == (NULL_BLOCK_ID,) * 4
    m.commit(req, 24)
    m.free("remote")
    m.check_invariants()
