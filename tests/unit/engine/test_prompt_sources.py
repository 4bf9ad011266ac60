"""Where admitted prompts' tokens come from (engine/prompt_sources.py), as vLLM's metrics count it: the totals'
arithmetic, and the scheduler's counts for a computed prompt, a local hit, and a preempted request admitted again
(not counted twice); a pull after a local hit is counted in test_engine_scheduler.py's scenario of it."""

from __future__ import annotations

import pytest

from hybridpd.engine.prompt_sources import CacheHitSource, PromptSources, PromptTokenSource

from tests.unit.engine.sched_harness import all_free, fa, make_kv, make_scheduler, make_seq, step

MAX_STEPS = 500


@pytest.mark.parametrize("prompt, local, pulled, stored, external, expected", [
    # prompt, local hit, pulled, stored, a connector or tier -> (external queries, external hits, computed)
    (20, 0, 0, 0, False, (0, 0, 20)),
    (20, 8, 0, 0, False, (0, 0, 12)),
    (20, 8, 0, 0, True, (12, 0, 12)),
    (20, 8, 12, 0, True, (12, 12, 0)),
    (20, 0, 0, 16, True, (20, 16, 4)),
    (20, 4, 8, 8, True, (16, 16, 0)),
])
def test_an_admission_adds_up_as_vllm_counts_it(prompt, local, pulled, stored, external, expected):
    totals = PromptSources().admitted(7, 3, external=True).admitted(prompt, local, pulled=pulled, stored=stored,
                                                                    external=external)
    external_queries, external_hits, computed = expected
    assert totals.queries == totals.prompt_tokens == 7 + prompt and totals.local_hits == 3 + local
    assert totals.external_queries == 4 + external_queries and totals.external_hits == external_hits
    by_tier = totals.cached_by_source()
    assert set(by_tier) == set(CacheHitSource)                     # every label vLLM exports, zeros included
    assert by_tier[CacheHitSource.DEVICE] == totals.local_hits and by_tier[CacheHitSource.P2P] == pulled
    assert by_tier[CacheHitSource.DISK] == stored
    assert sum(by_tier.values()) == totals.cached == totals.local_hits + totals.external_hits
    by_source = totals.by_source()
    assert by_source[PromptTokenSource.LOCAL_COMPUTE] == 4 + computed
    assert sum(by_source.values()) == totals.queries


def test_with_prefix_caching_off_nothing_is_looked_up_locally():
    totals = PromptSources().admitted(20, 0, external=True, pulled=12, looked_up=False)
    assert (totals.prompt_tokens, totals.queries, totals.external_queries, totals.external_hits) == (20, 0, 20, 12)
    assert totals.by_source()[PromptTokenSource.LOCAL_COMPUTE] == 8


@pytest.mark.parametrize("local, pulled, stored", [(-1, 0, 0), (8, 8, 8), (0, 21, 0)])
def test_more_tokens_than_the_prompt_holds_is_refused(local, pulled, stored):
    with pytest.raises(ValueError, match="cannot take"):
        PromptSources().admitted(20, local, pulled=pulled, stored=stored, external=True)


def run_to_end(sched) -> None:
    for _ in range(MAX_STEPS):
        if not sched.has_work():
            return
        step(sched)
    raise AssertionError("no progress")


def test_a_node_without_a_connector_counts_local_hits_and_no_external_queries():
    kv = make_kv()
    sched = make_scheduler(kv)
    sched.add(make_seq("a", 20, max_tokens=1))
    run_to_end(sched)
    sched.add(make_seq("b", 20, max_tokens=1))
    run_to_end(sched)
    assert sched.sources == PromptSources(prompt_tokens=40, queries=40, local_hits=16, external_queries=0)
    assert all_free(kv)


def test_a_preempted_request_admitted_again_is_not_counted_again():
    kv = make_kv((fa(4),), blocks=7)        # 6 usable blocks: 16 tokens each do not fit twice
    sched = make_scheduler(kv)
    a, b = make_seq("a", 8, max_tokens=8), make_seq("b", 8, max_tokens=8, base=1)
    sched.add(a)
    sched.add(b)
    preempted = False
    for _ in range(MAX_STEPS):
        if not sched.has_work():
            break
        plan, _ = step(sched)
        preempted = preempted or bool(plan.preempted)
    assert preempted and b.num_preemptions == 1
    assert sched.sources.queries == 16
    assert all_free(kv)
