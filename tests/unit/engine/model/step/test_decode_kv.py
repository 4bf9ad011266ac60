"""DecodeKV: decode-only steps of attention groups read contiguous buffers instead of gathering blocks.

The run bookkeeping as a table (which steps refill, which append, which fall back to the gather path), then the
whole engine with the buffers against the engine without them, step by step, through every way a run breaks:
sequences that finish or arrive (mixed steps), buffers that grow past LENGTH_STEP while appending, a preempted
and recomputed sequence, a byte budget that runs out mid-run, and a long sequence beside short ones (attention in
two runs of rows, whose choice is checked against a brute force).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.model.step.decode_kv import LENGTH_STEP, SPLIT_MIN_KEYS, DecodeKV, runs_of_rows

from tests.unit.engine.engine_harness import drive, greedy, make_recording_engine, prompt

TOKEN_BYTES = 2 * 8 * 4  # 2 KV heads of 8 floats


ALL = "all"  # every row filled from the paged cache


@pytest.mark.parametrize("steps, expected", [
    ([(("a", "b"), [5, 9]), (("a", "b"), [6, 10]), (("a", "b"), [7, 11])], [ALL, ((), ()), ((), ())]),
    ([(("a", "b"), [5, 9]), (("b", "a"), [10, 6])], [ALL, (((1, 0),), (1,))]),      # another order: a refilled
    ([(("a", "b"), [5, 9]), (("a",), [6])], [ALL, ((), ())]),                       # b finished
    ([(("a", "b", "c"), [5, 9, 3]), (("b", "c", "d"), [10, 4, 7])],
     [ALL, (((1, 0), (2, 1)), (2,))]),                                              # a left, d joined: b, c move up
    ([(("a", "b", "c"), [5, 9, 3]), (("c", "a"), [4, 6])], [ALL, (((2, 0),), (1,))]),
    ([(("a",), [5]), (("a",), [7])], [ALL, ALL]),                                   # a position it does not hold
    ([(("a",), [5]), "end", (("a",), [6])], [ALL, None, ALL]),                      # a failed forward in between
    ([(("a", None), [5, 9])], ["gather"]),                                          # a sequence without a key
    ([(("a", "b"), [LENGTH_STEP - 2, 9]), (("a", "b"), [LENGTH_STEP - 1, 10]), (("a", "b"), [LENGTH_STEP, 11])],
     [ALL, ((), ()), "gather"]),                                                    # over the byte budget
])
def test_run_bookkeeping(steps, expected):
    decode_kv = DecodeKV(max_bytes_per_layer=2 * 3 * LENGTH_STEP * TOKEN_BYTES)  # 3 rows of LENGTH_STEP positions
    got = []
    for step in steps:
        if step == "end":
            decode_kv.end_runs()
            got.append(None)
            continue
        keys, positions = step
        plan = decode_kv.plan(0, keys, positions, TOKEN_BYTES, torch.float32)
        got.append("gather" if plan is None else ALL if len(plan.fills) == len(keys) else (plan.moves, plan.fills))
        if plan is not None:
            assert plan.length == max(positions) + 1
            visible = plan.bias[:, 0, 0] == 0
            assert visible.sum(1).tolist() == [p + 1 for p in positions]
            assert plan.first_keys.tolist() == [0] * len(positions)
            assert plan.end_keys.tolist() == [p + 1 for p in positions]
    assert got == expected


@pytest.mark.parametrize("positions, window", [([0], 5), ([3, 9], 5), ([20, 9, 14], 5), ([7], 8), ([7], 1)])
def test_a_window_plan_reads_from_the_first_window_on(positions, window):
    plan = DecodeKV().plan(0, [str(i) for i in range(len(positions))], positions, TOKEN_BYTES, torch.float32,
                           window)
    assert plan.start == max(0, min(positions) - window + 1) and plan.length == max(positions) + 1
    for row, p in enumerate(positions):
        visible = [plan.start + l for l in range(plan.length - plan.start) if plan.bias[row, 0, 0, l] == 0]
        assert visible == list(range(max(0, p - window + 1), p + 1))
        assert visible == list(range(plan.first_keys[row], plan.end_keys[row]))  # the kernel's ranges: the same


def test_growing_buffers_keep_what_they_hold():
    decode_kv = DecodeKV()
    first = decode_kv.plan(0, ("a",), [LENGTH_STEP - 1], TOKEN_BYTES, torch.float32)
    k, _ = decode_kv.buffers(7, first, 2, 8, torch.float32)
    k[0, :, : LENGTH_STEP] = torch.arange(LENGTH_STEP, dtype=torch.float32)[None, :, None]
    grown = decode_kv.plan(0, ("a",), [LENGTH_STEP], TOKEN_BYTES, torch.float32)
    assert not grown.fills and not grown.moves
    k2, v2 = decode_kv.buffers(7, grown, 2, 8, torch.float32)
    assert k2.shape == (1, 2, 2 * LENGTH_STEP, 8) and v2.shape == k2.shape
    assert torch.equal(k2[0, :, :LENGTH_STEP], k[0, :, :LENGTH_STEP])
    assert not k2[:, :, LENGTH_STEP:].any()  # zeros past what was held, never uninitialised memory


def make_engine(model_dir, *, decode_kv: bool, num_blocks: int = 400) -> tuple[LLMEngine, list]:
    engine, rows = make_recording_engine(model_dir, num_blocks=num_blocks, budget=512)
    if not decode_kv:
        engine.model.decode_kv = DecodeKV(max_bytes_per_layer=0)  # every plan refused: the gather path
    return engine, rows


@pytest.mark.parametrize("scenario", ["finish_and_arrive", "leave_and_join", "grow_past_length_step", "preempted",
                                      "budget", "long_beside_short"])
def test_engine_with_decode_kv_equals_the_gather_path(tiny_dir, scenario):
    arrivals = {
        "finish_and_arrive": {0: [greedy("a", prompt(1, 9), 12), greedy("b", prompt(2, 17), 5)],
                              6: [greedy("c", prompt(3, 5), 9)], 9: [greedy("d", prompt(4, 1), 4)]},
        # a leaves first (b and c move up), d's prefill runs beside their decodes, then d joins (filled alone)
        "leave_and_join": {0: [greedy("a", prompt(11, 7), 3), greedy("b", prompt(12, 30), 14),
                               greedy("c", prompt(13, 21), 14)], 6: [greedy("d", prompt(14, 40), 6)]},
        "grow_past_length_step": {0: [greedy("a", prompt(5, LENGTH_STEP - 6), 14),
                                      greedy("b", prompt(6, LENGTH_STEP - 3), 9)]},
        "preempted": {0: [greedy(f"p{i}", prompt(20 + i, 14 + 3 * i), 16) for i in range(3)]},
        "budget": {0: [greedy("a", prompt(7, LENGTH_STEP - 3), 8)]},
        # three short sequences, then a long one joins below them: attention reads the rows in two runs
        "long_beside_short": {0: [greedy(f"s{i}", prompt(30 + i, 5 + i), 40) for i in range(3)],
                              3: [greedy("long", prompt(40, 3 * LENGTH_STEP), 8)]},
    }[scenario]
    num_blocks = 14 if scenario == "preempted" else 400
    engines = [make_engine(tiny_dir, decode_kv=on, num_blocks=num_blocks) for on in (True, False)]
    if scenario == "budget":  # room for one row of LENGTH_STEP positions in the kv_heads=2 group: refused at 256
        engines[0][0].model.decode_kv = DecodeKV(max_bytes_per_layer=2 * LENGTH_STEP * 2 * 16 * 4)
    decode_kv = engines[0][0].model.decode_kv
    outcomes: list[str] = []
    plan = decode_kv.plan

    def spy(*args, **kwargs):
        result = plan(*args, **kwargs)
        refill = result is not None and len(result.fills) == result.positions.shape[0]
        outcomes.append("gather" if result is None else "refill" if refill else "partial" if result.fills
                        else "move" if result.moves else "append")
        if result is not None and len(result.runs) > 1:
            outcomes.append("two runs")
        return result

    decode_kv.plan = spy
    preempted: list[str] = []
    for engine, _ in engines:
        original = engine.scheduler._preempt
        engine.scheduler._preempt = lambda seq, original=original: preempted.append(seq.request_id) or original(seq)
    outputs = [drive(engine, arrivals)[0] for engine, _ in engines]
    assert outputs[0] == outputs[1]
    (_, rows_on), (_, rows_off) = engines
    assert len(rows_on) == len(rows_off)
    for step, (on, off) in enumerate(zip(rows_on, rows_off)):
        assert on.keys() == off.keys(), step
        for rid in on:
            torch.testing.assert_close(on[rid], off[rid], atol=1e-5, rtol=0, msg=f"{rid} at step {step}")
    assert "append" in outcomes and "refill" in outcomes
    if scenario == "leave_and_join":
        assert "move" in outcomes and "partial" in outcomes
    if scenario == "grow_past_length_step":
        assert max(k.shape[2] for k, _ in decode_kv._buffers.values()) > LENGTH_STEP
    if scenario == "budget":
        assert outcomes.index("gather") > outcomes.index("append")
    if scenario == "preempted":
        assert preempted, "the scenario must preempt"
    assert ("two runs" in outcomes) == (scenario == "long_beside_short"), outcomes


def brute_force_runs(positions: list[int], window: int | None) -> tuple[int, int]:
    """(key reads of one run, the fewest key reads of any split in two runs, in the rows' order)."""
    def need(p):
        return (0 if window is None else max(0, p - window + 1)), p + 1

    def reads(rows):
        spans = [need(p) for p in rows]
        return len(rows) * (max(e for _, e in spans) - min(b for b, _ in spans))

    splits = [reads(positions[:k]) + reads(positions[k:]) for k in range(1, len(positions))]
    return reads(positions), min(splits, default=reads(positions))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=12), st.sampled_from([None, 64, 700]))
def test_attention_runs_cover_every_row_and_split_only_where_it_saves_enough(positions, window):
    runs = runs_of_rows(positions, window)
    assert [r[0] for r in runs] == [0, *[r[1] for r in runs[:-1]]] and runs[-1][1] == len(positions)
    for first_row, end_row, first_key, end_key in runs:   # each row's keys inside its run's columns
        for p in positions[first_row:end_row]:
            assert first_key <= (0 if window is None else max(0, p - window + 1)) and p + 1 <= end_key
    one, best = brute_force_runs(positions, window)
    reads = sum((end_row - first_row) * (end_key - first_key) for first_row, end_row, first_key, end_key in runs)
    if len(runs) == 1:
        assert reads == one and (one - best < SPLIT_MIN_KEYS or 2 * best > one)
    else:
        assert reads == best and one - best >= SPLIT_MIN_KEYS and 2 * best <= one


def test_buffers_stay_within_the_budget_their_plans_were_checked_against():
    """Many short rows, then few long ones: the buffers are sized for the step at hand (what its plan was checked
    against), not for the most rows and the longest length ever seen together; what they held is kept."""
    kv_heads, head_dim = 2, TOKEN_BYTES // (2 * 4)
    budget = 2 * 4 * LENGTH_STEP * TOKEN_BYTES  # K and V of 4 rows x LENGTH_STEP positions
    decode_kv = DecodeKV(max_bytes_per_layer=budget)
    wide = decode_kv.plan(0, ("a", "b", "c", "d"), [5, 5, 5, 5], TOKEN_BYTES, torch.float32)
    k, _ = decode_kv.buffers(7, wide, kv_heads, head_dim, torch.float32)
    k[3, :, :6] = 3.0  # d's keys
    moved = decode_kv.plan(0, ("c", "d"), [6, 6], TOKEN_BYTES, torch.float32)  # a and b left
    assert moved.moves == ((2, 0), (3, 1)) and not moved.fills
    # as the move kernel takes them: sources, targets, the keys each held row brings (its position)
    assert [a.tolist() for a in moved.move_arrays] == [[2, 3], [0, 1], [6, 6]]
    k, _ = decode_kv.buffers(7, moved, kv_heads, head_dim, torch.float32)
    k[1] = k[3]  # what the attention layer does with the move
    longer = decode_kv.plan(0, ("e", "d"), [LENGTH_STEP + 1, 7], TOKEN_BYTES, torch.float32)
    assert longer is not None and longer.fills == (0,) and not longer.moves
    k, v = decode_kv.buffers(7, longer, kv_heads, head_dim, torch.float32)
    assert k.shape == (2, kv_heads, 2 * LENGTH_STEP, head_dim)
    assert (k.numel() + v.numel()) * k.element_size() <= budget
    assert torch.equal(k[1, :, :6], torch.full((kv_heads, 6, head_dim), 3.0))  # d's keys came along


@pytest.mark.parametrize("arrivals", [
    {0: [greedy("a", prompt(11, 7), 3), greedy("b", prompt(12, 30), 14), greedy("c", prompt(13, 21), 14)],
     6: [greedy("d", prompt(14, 40), 6)]},                                        # rows move, one joins
    {0: [greedy(f"s{i}", prompt(30 + i, 5 + i), 20) for i in range(3)],
     3: [greedy("long", prompt(40, 3 * LENGTH_STEP), 8)]},                        # two runs of rows for SDPA
])
def test_the_compiled_decode_attention_equals_sdpa_over_the_buffers(tiny_dir, arrivals, monkeypatch):
    """The kernel (one thread) and SDPA (more threads) read the same buffers: the same tokens, logits to float32
    rounding, through moves, fills, a sliding window and a long row beside short ones."""
    from hybridpd.engine.model.layers import attention

    results = []
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(attention, "_kernel_attends", lambda qkv: False)
        engine, rows = make_engine(tiny_dir, decode_kv=True)
        results.append((drive(engine, arrivals)[0], rows))
    (tokens_kernel, rows_kernel), (tokens_sdpa, rows_sdpa) = results
    assert tokens_kernel == tokens_sdpa
    for on, off in zip(rows_kernel, rows_sdpa, strict=True):
        for rid in on:
            torch.testing.assert_close(on[rid], off[rid], atol=1e-5, rtol=0)
