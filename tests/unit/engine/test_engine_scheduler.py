"""The scheduler over a real KVCacheManager on tiny specs; no model: steps sample made-up tokens.

After every step the pool invariant must hold (`step` checks it), and every scenario ends with all blocks free.
"""

from __future__ import annotations

import pytest

from hybridpd.config import SchedulingPolicy
from hybridpd.engine.prompt_sources import PromptSources
from hybridpd.engine.request import FinishReason, RequestStatus
from hybridpd.engine.waiting_order import shortest_first

from .sched_harness import (
    EOS,
    FILLER,
    FIRST_TOKEN,
    HYBRID,
    REMOTE_DECODE,
    FakeLoader,
    all_free,
    fa,
    make_kv,
    make_scheduler,
    make_seq,
    mamba,
    remote_params,
    step,
    sw,
)

MAX_STEPS = 500


def run_to_end(sched, on_plan=lambda plan: None) -> int:
    steps = 0
    while sched.has_work():
        plan, _ = step(sched)
        on_plan(plan)
        steps += 1
        assert steps < MAX_STEPS, "no progress"
    return steps


@pytest.mark.parametrize("budget, boundary", [(5, None), (16, None), (33, None), (16, 8), (8, 8), (40, 16)])
def test_token_budget_is_respected_and_everyone_finishes(budget, boundary):
    specs = (fa(4), sw(5, 4), mamba(8)) if boundary != 16 else (fa(4), sw(5, 4), mamba(16))
    kv = make_kv(specs)
    sched = make_scheduler(kv, budget=budget, chunk_boundary=boundary)
    seqs = [make_seq(f"r{i}", n, max_tokens=4, base=i) for i, n in enumerate((40, 3, 17, 25))]
    for seq in seqs:
        sched.add(seq)

    def within_budget(plan):
        assert plan.num_tokens <= budget

    run_to_end(sched, within_budget)
    assert [(s.finish_reason, len(s.output_token_ids)) for s in seqs] == [(FinishReason.LENGTH, 4)] * 4
    assert all_free(kv)


@pytest.mark.parametrize("cached_slots", [0, 2, 8])
def test_saving_mamba_states_never_delays_admission(cached_slots):
    """A Mamba pool sized as the engine sizes it (running slots for max_num_seqs, then a few cached states): every
    prompt crosses many boundaries and wants their states saved, yet all of them start in the first step (saves
    took the slots of requests admitted after them, which then waited a step each)."""
    seqs_n = 6
    kv = make_kv((fa(4), mamba(8)), blocks=(256, 1 + seqs_n + cached_slots))
    sched = make_scheduler(kv, budget=6 * 48, max_num_seqs=seqs_n, chunk_boundary=8)
    seqs = [make_seq(f"r{i}", 48, max_tokens=2, base=i, skip_mamba_align=False) for i in range(seqs_n)]
    for seq in seqs:
        sched.add(seq)
    plan, _ = step(sched)
    assert sorted(s.seq.request_id for s in plan.scheduled) == sorted(seq.request_id for seq in seqs)
    run_to_end(sched)
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert all_free(kv)


@pytest.mark.parametrize("boundary, expected_b", [(None, 15), (8, 8)])
def test_decodes_come_before_prefills(boundary, expected_b):
    sched = make_scheduler(make_kv(), budget=16, chunk_boundary=boundary)
    a, b = make_seq("a", 8, max_tokens=10), make_seq("b", 40, base=3)
    sched.add(a)
    step(sched)
    sched.add(b)
    plan, _ = step(sched)
    assert [(item.seq.request_id, item.num_new_tokens) for item in plan.scheduled] == [("a", 1), ("b", expected_b)]
    assert plan.scheduled[0].samples and not plan.scheduled[1].samples


@pytest.mark.parametrize("budget, boundary, prompt_len, expected_chunks", [
    (20, 8, 40, [16, 16, 8]),
    (13, 8, 40, [8, 8, 8, 8, 8]),
    (32, 8, 70, [32, 32, 6]),
    (20, 16, 50, [16, 16, 18]),
    (20, 16, 60, [16, 16, 16, 12]),
    (64, 8, 40, [40]),
    (8, 8, 17, [8, 8, 1]),
    (20, None, 50, [20, 20, 10]),
    (5, 8, 20, [5, 3, 5, 3, 4]),    # a budget below the boundary still makes progress, and re-aligns
])
def test_unfinished_prefill_chunks_end_on_the_mamba_boundary(budget, boundary, prompt_len, expected_chunks):
    specs = (fa(4), sw(5, 4), mamba(boundary or 8))
    kv = make_kv(specs)
    sched = make_scheduler(kv, budget=budget, chunk_boundary=boundary)
    seq = make_seq("a", prompt_len, max_tokens=1)
    sched.add(seq)
    chunks = []
    while sched.has_work():
        plan, _ = step(sched)
        chunks.append(plan.scheduled[0].num_new_tokens)
    assert chunks == expected_chunks
    assert all_free(kv)


def test_a_prefix_hit_keeps_chunks_aligned():
    kv = make_kv()
    sched = make_scheduler(kv, budget=12, chunk_boundary=8)
    sched.add(make_seq("a", 24, max_tokens=1))
    run_to_end(sched)
    b = make_seq("b", 40, max_tokens=1)     # its first 24 tokens are a's prompt
    sched.add(b)
    plan, _ = step(sched)
    assert b.num_cached_tokens == 24        # a multiple of LCM(4, 8): the Mamba state at 24 was saved
    assert plan.scheduled[0].num_new_tokens == 8   # 24 + 12 would end at 36: cut back to 32


@pytest.mark.parametrize("max_num_seqs, num_requests", [(1, 3), (2, 5), (3, 3)])
def test_max_num_seqs_is_respected(max_num_seqs, num_requests):
    kv = make_kv()
    sched = make_scheduler(kv, budget=64, max_num_seqs=max_num_seqs)
    seqs = [make_seq(f"r{i}", 9 + i, max_tokens=3, base=i) for i in range(num_requests)]
    for seq in seqs:
        sched.add(seq)

    def check(plan):
        assert len(plan.scheduled) <= max_num_seqs and len(sched.running) <= max_num_seqs

    run_to_end(sched, check)
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert all_free(kv)


def test_loaded_remote_requests_wait_for_room_under_max_num_seqs():
    kv, loader = make_kv(), FakeLoader()
    sched = make_scheduler(kv, max_num_seqs=2, loader=loader)
    a, b = make_seq("a", 8, max_tokens=3), make_seq("b", 8, max_tokens=6, base=1)
    remote = make_seq("remote", 20, kv_transfer=remote_params(20), base=5)
    sched.add(a)
    sched.add(remote)
    sched.add(b)
    step(sched)                                       # a runs, remote loads (not counted), b runs
    assert sched.running == [a, b] and list(sched.loading) == ["remote"]
    sched.finish_load("remote", ok=True)
    while not a.is_finished:
        plan, _ = step(sched)
        assert len(sched.running) <= 2 and remote not in [item.seq for item in plan.scheduled]
    plan, _ = step(sched)                             # a finished: room for the loaded request
    assert [item.seq for item in plan.scheduled] == [b, remote]

    def at_most_two_running(plan):
        assert len(sched.running) <= 2

    run_to_end(sched, at_most_two_running)
    assert remote.finish_reason is FinishReason.LENGTH and all_free(kv)


def test_preemption_takes_the_last_admitted_and_requeues_it_first():
    kv = make_kv((fa(4),), blocks=7)        # 6 usable blocks: 16 tokens each do not fit twice
    sched = make_scheduler(kv)
    a, b, c = make_seq("a", 8, max_tokens=8), make_seq("b", 8, max_tokens=8, base=1), make_seq("c", 10, base=2)
    sched.add(a)
    sched.add(b)
    preempted = []
    while not preempted:
        plan, _ = step(sched)
        preempted = list(plan.preempted)
        if len(a.all_token_ids) == 9:
            sched.add(c)                     # waits: no room for it behind a and b
    assert preempted == [b]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert kv.block_table("b") == ((),)
    assert list(sched.waiting)[:2] == [b, c]
    assert [item.seq for item in plan.scheduled] == [a]
    outputs_before = len(b.output_token_ids)
    run_to_end(sched)
    assert [(s.finish_reason, len(s.output_token_ids)) for s in (a, b)] == [(FinishReason.LENGTH, 8)] * 2
    assert outputs_before > 0 and b.output_token_ids[:outputs_before] == [7] * outputs_before
    assert all_free(kv)


def test_a_request_preempts_itself_when_nothing_else_can_go():
    kv = make_kv((fa(4),), blocks=4)        # 3 usable blocks: 12 tokens
    sched = make_scheduler(kv)
    a = make_seq("a", 8, max_tokens=8)
    sched.add(a)
    preempted = []
    for _ in range(10):
        plan, _ = step(sched)
        preempted.extend(plan.preempted)
        if preempted:
            break
    assert preempted == [a] and a.status is RequestStatus.PREEMPTED and all_free(kv)
    sched.finish(a, FinishReason.ABORT)
    assert not sched.has_work() and all_free(kv)


@pytest.mark.parametrize("prompt_len", [2, 9, 20, 33])
def test_remote_prefill_waits_for_the_loader_with_the_right_targets(prompt_len):
    kv, loader = make_kv(), FakeLoader()
    sched = make_scheduler(kv, loader=loader)
    seq = make_seq("r", prompt_len, kv_transfer=remote_params(prompt_len))
    sched.add(seq)
    plan, _ = step(sched)
    assert plan.scheduled == ()
    assert seq.status is RequestStatus.WAITING_FOR_REMOTE_KV and sched.loading == {"r": seq}
    assert not sched.has_work() and sched.num_unfinished() == 1
    (rid, hit, blocks), = loader.started
    assert (rid, hit) == ("r", 0)
    for spec, load, table in zip(HYBRID, blocks.load, blocks.block_tables):
        start, end = spec.needed_span(prompt_len)
        assert [i for i, _ in load] == list(range(start, end)), spec.kind
        assert all(table[i] == local for i, local in load)
    sched.finish_load("r", ok=True)
    assert seq.num_computed_tokens == prompt_len and seq.status is RequestStatus.RUNNING
    assert seq.remote_prefill is None
    plan, touched = step(sched)                        # computes the first token, samples the second
    assert [(item.seq, item.num_new_tokens, item.samples) for item in plan.scheduled] == [(seq, 1, True)]
    assert touched == [seq] and seq.output_token_ids == [FIRST_TOKEN, 7]
    run_to_end(sched)
    assert seq.finish_reason is FinishReason.LENGTH and all_free(kv)


def test_remote_prefill_pulls_only_what_the_local_hit_lacks():
    kv, loader = make_kv(), FakeLoader()
    sched = make_scheduler(kv, loader=loader)
    sched.add(make_seq("local", 20, max_tokens=1))
    run_to_end(sched)
    sched.add(make_seq("r", 20, kv_transfer=remote_params(20)))
    step(sched)
    (_, hit, blocks), = loader.started
    assert hit == 16                                   # full attention alone decides (Mamba skipped)
    # vLLM's prompt sources: the local request queried outside (a connector is there) and found nothing; the remote
    # one took 16 tokens here and pulls 4
    assert sched.sources == PromptSources(prompt_tokens=40, queries=40, local_hits=16, external_queries=24, pulled=4)
    # Full attention pulls the block after its hit (a hit stops short of the prompt's end); the window's one
    # visible block is full and held here under its hash, so it is taken from the local cache, not pulled.
    assert [[i for i, _ in load] for load in blocks.load] == [[4], [], [0]]
    sched.finish_load("r", ok=True)
    run_to_end(sched)
    assert all_free(kv)


def test_abort_while_loading_frees_the_blocks_only_when_the_load_stops():
    kv, loader = make_kv(), FakeLoader()
    sched = make_scheduler(kv, loader=loader)
    seq = make_seq("r", 20, kv_transfer=remote_params(20))
    sched.add(seq)
    step(sched)
    held = kv.block_table("r")
    free_before = [kv.num_free_blocks(g) for g in range(3)]
    sched.finish(seq, FinishReason.ABORT)
    assert seq.is_finished and kv.block_table("r") == held           # a READ may still be writing into them
    assert [kv.num_free_blocks(g) for g in range(3)] == free_before
    kv.check_invariants()
    assert sched.finish_load("r", ok=True) is None
    assert all_free(kv) and sched.num_unfinished() == 0
    assert sched.finish_load("r", ok=True) is None                     # a second completion is ignored


def test_failed_load_can_recompute_locally():
    kv, loader = make_kv(), FakeLoader()
    sched = make_scheduler(kv, loader=loader)
    other = make_seq("other", 6, base=9)
    seq = make_seq("r", 20, kv_transfer=remote_params(20))
    sched.add(seq)
    step(sched)
    sched.add(other)
    assert sched.finish_load("r", ok=False) is seq
    sched.recompute_locally(seq)
    assert list(sched.waiting) == [seq, other]
    assert seq.status is RequestStatus.WAITING and seq.num_computed_tokens == 0 and not seq.skip_mamba_align
    plan, _ = step(sched)
    assert plan.scheduled[0].seq is seq and plan.scheduled[0].num_new_tokens == 21   # the prompt and its first token
    run_to_end(sched)
    assert seq.finish_reason is FinishReason.LENGTH and len(seq.output_token_ids) == 4 and all_free(kv)


def test_a_remote_prefill_without_a_loader_is_computed_here_with_the_common_hit():
    kv = make_kv()
    sched = make_scheduler(kv)
    sched.add(make_seq("local", 20, max_tokens=1))
    run_to_end(sched)
    seq = make_seq("r", 24, kv_transfer=remote_params(24))
    sched.add(seq)
    plan, _ = step(sched)
    item, = plan.scheduled
    assert seq.num_cached_tokens == 16 and item.num_new_tokens == 9      # every group decides: LCM(4, 8); + token 1
    assert all(load == () for load in item.blocks.load)
    run_to_end(sched)
    assert all_free(kv)


@pytest.mark.parametrize("prompt_len, budget, max_tokens, first, reason", [
    (20, 64, 4, FILLER, FinishReason.LENGTH),          # ends at its first token whatever max_tokens says
    (20, 8, 1, FILLER, FinishReason.LENGTH),           # chunked
    (2, 64, 4, EOS, FinishReason.STOP),                # an EOS first token ends it the same way (the decoder sees it)
    (1, 64, 4, FILLER, FinishReason.LENGTH),           # a one-token prompt is leased like any other
])
def test_a_prefill_role_request_computes_the_prompt_samples_once_and_keeps_its_blocks(prompt_len, budget, max_tokens,
                                                                                     first, reason):
    kv = make_kv()
    sched = make_scheduler(kv, budget=budget)
    seq = make_seq("p", prompt_len, kv_transfer=REMOTE_DECODE, max_tokens=max_tokens, ignore_eos=False)
    sched.add(seq)
    touched = []
    for _ in range(20):
        plan, touched = step(sched, {"p": first})
        if touched:
            break
        assert not any(item.samples for item in plan.scheduled)
    assert touched == [seq] and seq.num_computed_tokens == prompt_len and seq.output_token_ids == [first]
    assert not sched.has_work() and seq.status is RequestStatus.FINISHED and seq.finish_reason is reason
    assert sched.holds(seq) and any(kv.block_table("p")[0])   # full attention holds the prompt for the lease
    kv.free("p")
    assert all_free(kv)


def test_an_aborted_prefill_role_request_holds_nothing():
    kv = make_kv()
    sched = make_scheduler(kv, budget=8)
    seq = make_seq("p", 20, kv_transfer=REMOTE_DECODE)
    sched.add(seq)
    step(sched)
    sched.finish(seq, FinishReason.ABORT)
    assert not sched.holds(seq) and all_free(kv)


@pytest.mark.parametrize("end", ["abort", "fail"])
def test_a_remote_prefill_that_ends_before_its_pull_lets_the_prefill_node_go(end):
    kv, loader = make_kv(), FakeLoader()
    sched = make_scheduler(kv, loader=loader, max_num_seqs=1)
    sched.add(make_seq("busy", 6))
    step(sched)
    seq = make_seq("r", 20, kv_transfer=remote_params(20))
    sched.add(seq)
    step(sched)                                        # max_num_seqs: it waits
    assert seq.status is RequestStatus.WAITING and loader.started == []
    if end == "abort":
        sched.finish(seq, FinishReason.ABORT)
    else:
        sched.finish(seq, FinishReason.ERROR, RequestStatus.FAILED)
    assert loader.discarded == ["r"] and seq.remote_prefill is None
    run_to_end(sched)
    assert loader.started == [] and all_free(kv)


@pytest.mark.parametrize("prompt_len, max_tokens, ignore_eos, max_model_len, tokens, reason, num_out", [
    (10, 5, False, 4096, [3, EOS, 3], FinishReason.STOP, 2),
    (10, 5, True, 4096, [3, EOS, 3, 3, 3], FinishReason.LENGTH, 5),
    (10, 3, False, 4096, [3, 3, 3], FinishReason.LENGTH, 3),
    (10, 1, False, 4096, [EOS], FinishReason.STOP, 1),          # EOS wins over max_tokens on the same token
    (10, 9, False, 12, [3, 3], FinishReason.LENGTH, 2),         # max_model_len
    (11, 9, False, 12, [3], FinishReason.LENGTH, 1),
])
def test_finish_reasons(prompt_len, max_tokens, ignore_eos, max_model_len, tokens, reason, num_out):
    kv = make_kv()
    sched = make_scheduler(kv, max_model_len=max_model_len)
    seq = make_seq("a", prompt_len, max_tokens=max_tokens, ignore_eos=ignore_eos)
    sched.add(seq)
    feed = iter(tokens)
    while sched.has_work():
        plan = sched.schedule()
        sampled = {item.seq.request_id: next(feed) for item in plan.scheduled if item.samples}
        sched.update(plan, sampled)
        kv.check_invariants()
    assert (seq.finish_reason, len(seq.output_token_ids)) == (reason, num_out)
    assert seq.output_token_ids == tokens[:num_out]
    assert all_free(kv)


def _plan_rows(plan) -> list[tuple[str, int]]:
    return [(item.seq.request_id, item.num_new_tokens) for item in plan.scheduled]


@pytest.mark.parametrize("cap, boundary, arrivals, expected_steps", [
    # No cap: the whole prompt joins the decode's step.
    (None, None, [("b", 20)], [[("a", 1), ("b", 20)]]),
    # A cap: the prompt is spread over steps that each carry the decode, until it decodes too.
    (8, None, [("b", 20)], [[("a", 1), ("b", 8)], [("a", 1), ("b", 8)], [("a", 1), ("b", 4)], [("a", 1), ("b", 1)]]),
    # Two prompts share the cap: the older one's chunk first.
    (8, None, [("b", 6), ("c", 6)], [[("a", 1), ("b", 6), ("c", 2)], [("a", 1), ("b", 1), ("c", 4)]]),
    # Chunks that stop short of the prompt still end on the Mamba boundary; the last one takes what is left.
    (12, 8, [("b", 20)], [[("a", 1), ("b", 8)], [("a", 1), ("b", 12)], [("a", 1), ("b", 1)]]),
    # A cap larger than the prompt changes nothing.
    (64, None, [("b", 20)], [[("a", 1), ("b", 20)]]),
])
def test_prefill_tokens_are_capped_while_a_request_decodes(cap, boundary, arrivals, expected_steps):
    kv = make_kv()
    sched = make_scheduler(kv, budget=64, prefill_cap=cap, chunk_boundary=boundary)
    sched.add(make_seq("a", 4, max_tokens=50))
    plan, _ = step(sched)
    assert _plan_rows(plan) == [("a", 4)]               # nobody decodes yet: the cap does not apply
    for rid, n in arrivals:
        sched.add(make_seq(rid, n, base=len(rid) * 7, max_tokens=50))
    for expected in expected_steps:
        plan, _ = step(sched)
        assert _plan_rows(plan) == expected
    for seq in [*sched.running]:
        sched.finish(seq, FinishReason.ABORT)
    assert all_free(kv)


@pytest.mark.parametrize("decoding, step_rows, expected_chunk", [
    (1, lambda rows: rows, 8),                    # products multiply what they are given: the cap
    (1, lambda rows: -(-rows // 16) * 16, 15),    # 8 + 1 rows cost 16: the prefill fills the 7 zero rows
    (3, lambda rows: -(-rows // 16) * 16, 13),
    (2, lambda rows: -(-rows // 10) * 10, 8),     # 8 + 2 rows are whole: nothing to fill
])
def test_the_cap_is_raised_to_the_rows_the_products_multiply_anyway(decoding, step_rows, expected_chunk):
    """While requests decode, a prompt's chunk takes the cap and then the rows the step's products would pad (the
    model's `product_rows`), never fewer than the cap."""
    kv = make_kv()
    sched = make_scheduler(kv, budget=64, prefill_cap=8, step_rows=step_rows)
    for i in range(decoding):
        sched.add(make_seq(f"d{i}", 4, base=40 * i, max_tokens=50))
    step(sched)
    sched.add(make_seq("p", 40, base=300, max_tokens=50))
    plan, _ = step(sched)
    assert _plan_rows(plan) == [*((f"d{i}", 1) for i in range(decoding)), ("p", expected_chunk)]
    for seq in [*sched.running]:
        sched.finish(seq, FinishReason.ABORT)
    assert all_free(kv)


def test_without_a_decoding_request_the_cap_does_not_apply():
    kv = make_kv()
    sched = make_scheduler(kv, budget=64, prefill_cap=8)
    sched.add(make_seq("a", 20))
    sched.add(make_seq("b", 20))
    plan, _ = step(sched)
    assert _plan_rows(plan) == [("a", 20), ("b", 20)]
    run_to_end(sched)
    assert all_free(kv)


def _sjf(kv, **kwargs):
    return make_scheduler(kv, policy=SchedulingPolicy.SJF, **kwargs)


@pytest.mark.parametrize("step_tokens, arrivals, expected_first_steps", [
    # Fewest tokens first; a step takes no further prompt once it carries step_tokens (the first is never cut).
    (10, [("a", 30), ("b", 6), ("c", 12)], [[("b", 6), ("c", 12)], [("b", 1), ("c", 1), ("a", 30)]]),
    (4, [("a", 30), ("b", 6), ("c", 12)], [[("b", 6)], [("b", 1), ("c", 12)], [("b", 1), ("c", 1), ("a", 30)]]),
    (40, [("a", 30), ("b", 6), ("c", 12)], [[("b", 6), ("c", 12), ("a", 30)]]),
    # Equal lengths keep arrival order.
    (5, [("a", 8), ("b", 8), ("c", 3)], [[("c", 3), ("a", 8)], [("c", 1), ("a", 1), ("b", 8)]]),
    # One prompt larger than step_tokens still takes the whole budget.
    (8, [("a", 50)], [[("a", 50)]]),
])
def test_sjf_takes_the_fewest_tokens_first_and_fills_a_step_up_to_its_size(step_tokens, arrivals,
                                                                            expected_first_steps):
    kv = make_kv()
    sched = _sjf(kv, step_tokens=step_tokens)
    seqs = [make_seq(rid, n, base=11 * i) for i, (rid, n) in enumerate(arrivals)]
    for seq in seqs:
        sched.add(seq)
    for expected in expected_first_steps:
        plan, _ = step(sched)
        assert _plan_rows(plan) == expected
    run_to_end(sched)
    assert [(s.finish_reason, len(s.output_token_ids)) for s in seqs] == [(FinishReason.LENGTH, 4)] * len(seqs)
    assert all_free(kv)


def test_sjf_ranks_by_what_the_local_hit_leaves():
    """A long prompt whose prefix is cached ranks by the tokens it still computes."""
    kv = make_kv()
    sched = _sjf(kv, step_tokens=1)
    sched.add(make_seq("warm", 33, max_tokens=1))
    run_to_end(sched)                                        # its 32 full-attention tokens (and a Mamba state) cached
    sched.add(make_seq("fresh", 12, base=90))
    sched.add(make_seq("long", 40))                          # the same prefix: 32 cached, 8 to compute
    plan, _ = step(sched)
    assert [(item.seq.request_id, item.seq.num_cached_tokens) for item in plan.scheduled] == [("long", 32)]
    run_to_end(sched)
    assert all_free(kv)


def test_sjf_admits_a_request_that_waited_its_bound_before_shorter_ones():
    kv = make_kv()
    sched = _sjf(kv, step_tokens=1, max_wait=5.0)
    old, short = make_seq("old", 30), make_seq("short", 6, base=50)
    sched.add(old)
    sched.add(short)
    old.queued_at -= 5.0                                     # as if it arrived five seconds ago
    plan, _ = step(sched)
    assert _plan_rows(plan) == [("old", 30)]
    run_to_end(sched)
    assert all_free(kv)


def test_sjf_starts_a_pull_before_any_prompt_it_computes():
    """A remotely prefilled request computes nothing here: it goes first, whatever its length, and does not count
    against the step's prompt tokens."""
    kv = make_kv()
    loader = FakeLoader()
    sched = _sjf(kv, step_tokens=1, loader=loader)
    sched.add(make_seq("short", 6, base=50))
    sched.add(make_seq("pulled", 33, kv_transfer=remote_params(33)))
    plan, _ = step(sched)
    assert [rid for rid, _, _ in loader.started] == ["pulled"] and _plan_rows(plan) == [("short", 6)]
    sched.finish_load("pulled", ok=True)
    run_to_end(sched)
    assert all_free(kv)


@pytest.mark.parametrize("requests, expected", [
    # (id, uncached tokens, seconds waited, preemptions, pulled)
    ([("a", 30, 0, 0, False), ("b", 6, 0, 0, False), ("c", 12, 0, 0, False)], ["b", "c", "a"]),
    ([("a", 30, 0, 0, False), ("b", 6, 0, 0, False)] + [("c", 90, 2, 0, False)], ["c", "b", "a"]),   # waited
    ([("a", 30, 2, 0, False), ("b", 6, 0, 0, False), ("c", 90, 3, 0, False)], ["a", "c", "b"]),      # both waited
    ([("a", 30, 0, 0, False), ("b", 6, 0, 0, False), ("c", 90, 0, 1, False)], ["c", "b", "a"]),      # preempted
    ([("a", 30, 0, 0, False), ("b", 6, 0, 0, False), ("c", 90, 0, 0, True)], ["c", "b", "a"]),       # a pull
    ([("a", 8, 0, 0, False), ("b", 8, 0, 0, False), ("c", 8, 0, 0, False)], ["a", "b", "c"]),        # ties
])
def test_shortest_first_order(requests, expected):
    now = 100.0
    seqs = []
    for rid, uncached, waited, preemptions, pulled in requests:
        seq = make_seq(rid, max(uncached, 2), kv_transfer=remote_params(max(uncached, 2)) if pulled else None)
        seq.uncached_estimate, seq.queued_at, seq.num_preemptions = uncached, now - waited, preemptions
        seqs.append(seq)
    assert [seq.request_id for seq in shortest_first(seqs, now, max_wait=1.0)] == expected
