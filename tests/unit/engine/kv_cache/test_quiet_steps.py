"""Quiet steps (no group allocates, caches, saves or releases anything) take a short path through the manager.

Each scenario runs twice, on a manager whose quiet path is on and on one whose groups never report a quiet step;
after every allocate and commit both must agree on everything the engine and the pools see.
"""

from __future__ import annotations

import pytest

from hybridpd.config import MambaCacheMode
from hybridpd.engine.kv_cache.coordinator import KVCacheManager

from .builders import Req, all_free, fa, mamba, manager, prefill, sw


def without_quiet_path(m: KVCacheManager) -> KVCacheManager:
    for group_manager in m._managers:
        group_manager.quiet = lambda request_id, start, end: False
    return m


def snapshot(m: KVCacheManager, rids: list[str]):
    return (
        [m.block_table(r) for r in rids],
        [m.num_free_blocks(g) for g in range(len(m.groups))],
        m.stats(),
    )


def decode(managers: list[KVCacheManager], reqs: list[Req], steps: int, width: int) -> None:
    """`steps` steps of `width` new tokens for every request, on every manager alike."""
    for step in range(steps):
        for req in reqs:
            req.all_token_ids.extend(range(900 + step * width, 900 + (step + 1) * width))
            results = [m.allocate_slots(req, width) for m in managers]
            assert results[0] == results[1], f"{req.request_id} step {step}"
        for req in reqs:
            req.num_computed += width
            for m in managers:
                m.commit(req, req.num_computed)
                m.check_invariants()
        assert snapshot(managers[0], [r.request_id for r in reqs]) == snapshot(
            managers[1], [r.request_id for r in reqs])


@pytest.mark.parametrize("specs, caching, width, any_quiet", [
    ((fa(4),), True, 1, True),
    ((fa(4), sw(6, 4), mamba(8)), True, 1, True),
    ((fa(4), sw(5, 2), mamba(8)), True, 1, False),  # blocks of 2: every token starts or fills one
    ((fa(4), sw(13, 4), mamba(8)), True, 1, True),   # window releases off the block boundaries
    ((fa(4), fa(4, heads=8), sw(8, 4), sw(13, 4), mamba(16)), True, 1, True),
    ((fa(4), sw(6, 4), mamba(8)), False, 1, True),
    ((sw(7, 8), mamba(16)), True, 2, True),
    ((fa(8), mamba(16)), True, 3, True),
])
def test_quiet_path_agrees_with_the_full_path(specs, caching, width, any_quiet):
    managers = [manager(*specs, caching=caching), without_quiet_path(manager(*specs, caching=caching))]
    quiet_steps = []
    original = managers[0]._quiet_step_blocks
    managers[0]._quiet_step_blocks = lambda rid: quiet_steps.append(rid) or original(rid)
    reqs = [Req("a", list(range(100, 119))), Req("b", list(range(100, 110)) + list(range(300, 311)))]
    for req in reqs:
        hits = {prefill(m, Req(req.request_id, list(req.all_token_ids)), chunk=5) for m in managers}
        assert len(hits) == 1
        req.num_computed = req.num_prompt_tokens
    decode(managers, reqs, steps=40, width=width)
    assert bool(quiet_steps) == any_quiet
    for m in managers:
        for req in reqs:
            m.free(req.request_id)
        m.check_invariants()
        assert all_free(m)


def test_a_quiet_step_followed_by_a_preemption_frees_everything():
    m = manager(fa(4), sw(6, 4), mamba(8))
    req = Req("a", list(range(30)))
    prefill(m, req)
    req.num_computed = 30
    req.all_token_ids.append(7)
    step = m.allocate_slots(req, 1)   # token 30 lands in block 7 of 8: quiet
    assert step is not None and step.mamba[2].saves == () and step.load == ((), (), ())
    m.free("a")                       # preempted before the step ran: its quiet commit never comes
    m.check_invariants()
    assert all_free(m)
    prefill(m, Req("a", list(range(30))))   # the id is reused from scratch
    m.free("a")
    assert all_free(m)


def test_mamba_without_caching_is_quiet_across_interval_boundaries():
    m = manager(fa(8), mamba(8), mode=MambaCacheMode.NONE)
    req = Req("a", list(range(14)))
    prefill(m, req)
    req.num_computed = 14
    req.all_token_ids.append(1)
    assert m._managers[1].quiet("a", 14, 16)        # 16 is an interval boundary, but nothing is saved
    assert not m._managers[0].quiet("a", 14, 17)    # block 2 of the attention group is not allocated yet
    m.free("a")
