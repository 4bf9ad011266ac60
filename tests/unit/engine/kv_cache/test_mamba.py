import pytest

from hybridpd.config import MambaCacheMode

from .builders import Req, all_free, fa, mamba, manager, prefill

PROMPT = list(range(300, 330))   # 30 tokens


@pytest.mark.parametrize("chunk, expected_saves", [
    (30, [(8, 16, 24)]),
    (5, [(), (8,), (), (16,), (24,), ()]),
    (8, [(8,), (16,), (24,), ()]),
    (17, [(8, 16), (24,)]),
])
def test_a_save_slot_for_every_boundary_a_step_crosses(chunk, expected_saves):
    m = manager(fa(4), mamba(8))
    req = Req("a", list(PROMPT))
    computed, seen = 0, []
    while computed < 30:
        n = min(chunk, 30 - computed)
        step = m.allocate_slots(req, n)
        ops = step.mamba[1]
        assert step.mamba[0] is None and step.block_tables[1] == (ops.state_slot,)
        assert ops.state_slot not in [s for _, s in ops.saves]
        seen.append(tuple(n_tok for n_tok, _ in ops.saves))
        computed += n
        m.commit(req, computed)
        m.check_invariants()
    assert seen == expected_saves
    assert m.stats()[1].num_cached == 3
    m.free("a")
    assert all_free(m)


@pytest.mark.parametrize("shared, expected_hit", [(30, 24), (20, 16), (15, 8), (7, 0)])
def test_hit_copies_the_cached_state(shared, expected_hit):
    m = manager(fa(4), mamba(8))
    prefill(m, Req("a", list(PROMPT)))
    m.free("a")
    req = Req("b", PROMPT[:shared] + [1] * 6)
    hit = m.get_computed_blocks(req)
    assert hit.num_tokens == expected_hit
    step = m.allocate_slots(req, len(req.all_token_ids) - expected_hit, hit)
    ops = step.mamba[1]
    assert ops.copy_from == (hit.blocks[1][0] if expected_hit else None)
    free_during = m.num_free_blocks(1)
    m.commit(req, len(req.all_token_ids))
    m.check_invariants()
    if expected_hit:                    # the hit slot was held through the step, released by commit
        assert m.num_free_blocks(1) == free_during + 1 + len(ops.saves)
    m.free("b")
    assert all_free(m)


def test_mode_none_never_hits_nor_saves():
    m = manager(fa(4), mamba(8), mode=MambaCacheMode.NONE)
    prefill(m, Req("a", list(PROMPT)))
    m.free("a")
    assert m.stats()[1].num_cached == 0
    assert m.get_computed_blocks(Req("b", list(PROMPT))).num_tokens == 0
    skip = Req("c", list(PROMPT), skip_mamba_align=True)
    assert m.get_computed_blocks(skip).num_tokens == 28   # full attention alone decides


def test_saves_are_best_effort_when_slots_run_out():
    m = manager(fa(4), mamba(8), blocks=(64, 3))          # 2 usable slots: one running, one save
    step = m.allocate_slots(Req("a", list(PROMPT)), 30)
    assert step is not None
    assert [n for n, _ in step.mamba[1].saves] == [8]
    assert m.num_free_blocks(1) == 0                      # a's running slot and its one save took both
    assert m.allocate_slots(Req("b", list(PROMPT)), 30) is None  # no running slot left for b: refused, unchanged
    m.check_invariants()
    m.free("a")
    m.check_invariants()
    assert all_free(m)


@pytest.mark.parametrize("expected, saves_of_a, b_admitted", [
    (0, [8, 16], False),   # nobody else expected: a's saves take the slot b's running state needs
    (2, [8], True),        # a and b expected: a's saves leave b's running slot
    (3, [], True),         # a third expected too: nothing left to save into
])
def test_saves_leave_the_running_slots_of_expected_admissions(expected, saves_of_a, b_admitted):
    m = manager(fa(4), mamba(8), blocks=(64, 4))   # 3 usable slots
    a, b = Req("a", list(PROMPT)), Req("b", list(range(400, 430)))
    m.expect_admissions(expected)
    step = m.allocate_slots(a, 30)
    assert [n for n, _ in step.mamba[1].saves] == saves_of_a
    assert (m.allocate_slots(b, 30) is not None) == b_admitted
    m.check_invariants()
    m.commit(a, 30)
    m.free("a")
    m.free("b")
    m.check_invariants()
    assert all_free(m)


def test_remote_request_loads_the_running_state():
    m = manager(fa(4), mamba(8))
    req = Req("r", list(PROMPT), skip_mamba_align=True)
    hit = m.get_computed_blocks(req)
    step = m.allocate_slots(req, 1, hit, num_external_tokens=29)
    ops = step.mamba[1]
    assert step.load[1] == ((0, ops.state_slot),) and ops.copy_from is None and ops.saves == ()
    m.commit(req, 30)
    req.all_token_ids.append(7)                            # the first output token, decoded next
    later = m.allocate_slots(req, 1)
    assert later.load == ((), ())
    m.free("r")
    m.check_invariants()
    assert all_free(m)
