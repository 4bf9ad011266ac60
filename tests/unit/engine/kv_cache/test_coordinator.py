import pytest

from hybridpd.engine.kv_cache.block_pool import NULL_BLOCK_ID

from .builders import Req, all_free, fa, mamba, manager, prefill, sw

PROMPT = list(range(400, 440))   # 40 tokens


@pytest.mark.parametrize("specs, query, skip, expected_hit", [
    ((fa(4),), PROMPT, False, 36),
    ((fa(4), mamba(8)), PROMPT, False, 32),                  # LCM 8; Mamba saved at 8..40
    ((fa(4), fa(4, heads=8), sw(8, 4), mamba(8)), PROMPT, False, 32),
    ((fa(4), sw(8, 4), mamba(8)), PROMPT[:21] + [0] * 9, False, 16),
    ((fa(4), mamba(16)), PROMPT, False, 32),
    ((fa(4), mamba(16)), PROMPT[:30], False, 16),
    ((fa(4), mamba(8)), PROMPT[:30], True, 28),              # remote: full attention alone decides
    ((fa(4), sw(8, 4)), PROMPT[:30], True, 28),
    ((sw(8, 4), mamba(8)), PROMPT[:30], True, 0),            # no full-attention group: no local hit
    ((fa(2), fa(4)), PROMPT[:31], False, 28),
    ((fa(3), sw(5, 2)), PROMPT, False, 36),
])
def test_hit_every_group_serves(specs, query, skip, expected_hit):
    m = manager(*specs)
    prefill(m, Req("a", list(PROMPT)), chunk=8)
    m.free("a")
    req = Req("q", list(query), skip_mamba_align=skip)
    hit = m.get_computed_blocks(req)
    assert hit.num_tokens == expected_hit
    assert hit.num_tokens < req.num_prompt_tokens
    m.check_invariants()


def test_out_of_blocks_changes_nothing():
    m = manager(fa(4), sw(8, 4), mamba(8), blocks=(8, 8, 4))
    prefill(m, Req("a", list(PROMPT[:20])))
    before = (m.block_table("a"), [m.num_free_blocks(g) for g in range(3)], m.stats())
    big = Req("b", list(range(40)))
    hit = m.get_computed_blocks(big)
    assert m.allocate_slots(big, 40, hit) is None
    assert (m.block_table("a"), [m.num_free_blocks(g) for g in range(3)]) == before[:2]
    assert m.block_table("b") == ((), (), ())
    m.check_invariants()
    m.free("a")                                           # preempt a, retry
    assert m.allocate_slots(big, 28, hit) is not None
    m.free("b")
    m.free("b")
    m.check_invariants()
    assert all_free(m)


def test_remote_request_pulls_only_what_it_lacks():
    m = manager(fa(4), sw(8, 4), mamba(8))
    prefill(m, Req("local", list(PROMPT[:16])))
    m.free("local")
    req = Req("r", list(PROMPT), skip_mamba_align=True)
    hit = m.get_computed_blocks(req)
    assert hit.num_tokens == 16 and hit.blocks[1] == () and hit.blocks[2] == ()
    step = m.allocate_slots(req, 1, hit, num_external_tokens=23)    # [16, 39) remote, 39 here
    assert [i for i, _ in step.load[0]] == [4, 5, 6, 7, 8, 9]
    assert step.block_tables[0][:4] == hit.blocks[0]
    assert [i for i, _ in step.load[1]] == [8, 9]                   # the query at 39 sees [32, 39]
    assert step.block_tables[1][:8] == (NULL_BLOCK_ID,) * 8
    assert step.load[2] == ((0, step.mamba[2].state_slot),)
    m.commit(req, 40)
    m.check_invariants()
    m.free("r")
    assert all_free(m)


def test_later_calls_take_no_hit_and_counters_add_up():
    m = manager(fa(4), mamba(8))
    prefill(m, Req("a", list(PROMPT)))
    req = Req("b", list(PROMPT))
    hit = m.get_computed_blocks(req)
    m.allocate_slots(req, 40 - hit.num_tokens, hit)
    with pytest.raises(ValueError, match="first allocate_slots"):
        m.allocate_slots(req, 1, hit)
    stats = m.stats()
    assert [(s.queries, s.query_tokens, s.hit_tokens) for s in stats] == [(2, 80, 32), (2, 80, 32)]
    assert stats[0].kind == "full_attention" and stats[1].kind == "mamba"
    assert 0 < m.usage() <= 1
    m.free("a")
    m.free("b")
    assert m.usage() == 0 and all_free(m)


def test_stale_hit_is_refused():
    m = manager(fa(4), blocks=6)                           # 5 usable blocks
    prefill(m, Req("a", list(PROMPT[:12])))
    m.free("a")
    req = Req("b", list(PROMPT[:12]) + [1])
    hit = m.get_computed_blocks(req)
    assert hit.num_tokens == 12
    prefill(m, Req("c", list(range(900, 920))))            # evicts a's blocks
    m.free("c")
    with pytest.raises(ValueError, match="get_computed_blocks again"):
        m.allocate_slots(req, 1, hit)
    m.check_invariants()


def test_reset_prefix_cache():
    m = manager(fa(4), mamba(8))
    prefill(m, Req("a", list(PROMPT)))
    m.free("a")
    m.reset_prefix_cache()
    assert m.get_computed_blocks(Req("b", list(PROMPT))).num_tokens == 0
    assert all(s.num_cached == 0 for s in m.stats())


@pytest.mark.parametrize("lookups_before_it_fits", [0, 1, 5])
def test_a_request_is_counted_once_however_often_it_is_looked_up(lookups_before_it_fits):
    """A head-of-queue request that does not fit is looked up again every step; the statistics count it once,
    with the hit it finally takes (issue: inflated prefix-cache metrics)."""
    m = manager(fa(4), mamba(8))
    prefill(m, Req("a", list(PROMPT)))
    req = Req("b", list(PROMPT))
    for _ in range(lookups_before_it_fits):
        m.get_computed_blocks(req)  # the scheduler's lookup of a request that then does not fit
    hit = m.get_computed_blocks(req)
    m.allocate_slots(req, 40 - hit.num_tokens, hit)
    assert [(s.queries, s.query_tokens, s.hit_tokens) for s in m.stats()] == [(2, 80, 32), (2, 80, 32)]
    m.free("a")
    m.free("b")
    assert all_free(m)
