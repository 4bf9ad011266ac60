"""Mooncake trace replay: the reader (bad lines name their line), block synthesis (equal ids equal tokens, the same in
every process), the slice and its times, the ideal hit rate against a brute-force count over the prompts' tokens, and
the whole `hybridpd bench --dataset-name mooncake_trace` against a fake server."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridpd.bench import mooncake
from hybridpd.bench.main import bench_result
from hybridpd.bench.mooncake import TraceRecord, TraceSlice

VOCAB = 1000


def record(ts: float, input_length: int, ids: list[int], output: int = 8) -> dict:
    return {"timestamp": ts, "input_length": input_length, "output_length": output, "hash_ids": ids}


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "a JSON object"),
    (json.dumps(record(-1, 512, [0])), "'timestamp'"),
    (json.dumps({"input_length": 512, "output_length": 1, "hash_ids": [0]}), "'timestamp'"),
    (json.dumps(record(0, 0, [0])), "'input_length'"),
    (json.dumps({**record(0, 512, [0]), "output_length": 0}), "'output_length'"),
    (json.dumps(record(0, 512, [])), "'hash_ids'"),
    (json.dumps(record(0, 512, [0, -3])), "'hash_ids'"),
    (json.dumps(record(0, 512, [0, 1])), "spans 1 blocks of 512 tokens, but it has 2 hash ids"),   # too short
    (json.dumps(record(0, 1025, [0, 1])), "spans 3 blocks of 512 tokens, but it has 2 hash ids"),  # too long
])
def test_a_bad_trace_line_is_an_error_naming_the_line(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(record(0, 600, [0, 1])) + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as error:
        mooncake.read_trace(path)
    assert f"{path}:3:" in str(error.value)


def test_equal_ids_give_equal_blocks_different_ids_different_ones_in_every_process():
    assert mooncake.block_tokens(7, 16, VOCAB) == mooncake.block_tokens(7, 16, VOCAB)
    assert mooncake.block_tokens(7, 16, VOCAB) != mooncake.block_tokens(8, 16, VOCAB)
    assert all(0 <= t < VOCAB for t in mooncake.block_tokens(7, 16, VOCAB))
    code = "from hybridpd.bench.mooncake import block_tokens; print(list(block_tokens(7, 16, 1000)))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(other) == list(mooncake.block_tokens(7, 16, VOCAB))


def test_a_prompt_is_its_ids_blocks_then_a_tail_of_its_own():
    rng = np.random.default_rng(0)
    a = TraceRecord(timestamp_ms=0, input_length=1300, output_length=1, hash_ids=(1, 2, 3))
    b = TraceRecord(timestamp_ms=0, input_length=1300, output_length=1, hash_ids=(1, 2, 4))
    pa, pb = (mooncake.prompt_tokens(r, 16, VOCAB, rng) for r in (a, b))
    assert len(pa) == len(pb) == round(1300 * 16 / 512) == 41
    assert pa[:32] == pb[:32] == mooncake.block_tokens(1, 16, VOCAB) + mooncake.block_tokens(2, 16, VOCAB)
    assert pa[32:] != pb[32:]   # the last, partial block is each request's own


def prefix_tree_trace(seed: int, n: int, tph: int) -> list[TraceRecord]:
    """Random requests whose ids follow a prefix tree (as the published ids do: an id stands for its whole prefix)."""
    rng = random.Random(seed)
    chains: list[tuple[int, ...]] = [()]
    next_id, records = 0, []
    for i in range(n):
        base = rng.choice(chains)[:rng.randrange(0, 5)]
        ids = list(base)
        for _ in range(rng.randrange(1 if not base else 0, 4)):
            ids.append(next_id)
            next_id += 1
        chains.append(tuple(ids))
        length = (len(ids) - 1) * mooncake.TRACE_BLOCK + rng.randrange(1, mooncake.TRACE_BLOCK + 1)
        records.append(TraceRecord(timestamp_ms=i, input_length=length, output_length=1, hash_ids=tuple(ids)))
    return records


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tph", [4, 16])
@pytest.mark.parametrize("history", [0, 15])
def test_the_ideal_hit_rate_equals_a_brute_force_count_over_the_prompts(seed, tph, history):
    """The first `history` requests were served before the slice: they are hit, not counted."""
    records = prefix_tree_trace(seed, 40, tph)
    rng = np.random.default_rng(seed)
    prompts = [mooncake.prompt_tokens(r, tph, VOCAB, rng) for r in records]
    hits = 0
    for i, prompt in enumerate(prompts[history:], start=history):   # the longest whole-block prefix an earlier shares
        best = 0
        for earlier in prompts[:i]:
            k = 0
            while k < min(len(prompt), len(earlier)) and prompt[k] == earlier[k]:
                k += 1
            best = max(best, k // tph * tph)
        hits += best
    expected = (hits, sum(map(len, prompts[history:])))
    assert mooncake.ideal_hit_tokens(records[history:], tph, records[:history]) == expected


def test_the_history_is_the_seconds_before_the_slice_in_time_order():
    records = [TraceRecord(timestamp_ms=t, input_length=10, output_length=1, hash_ids=(0,))
               for t in (9000, 1000, 3000, 2000, 12000, 8999)]
    trace = TraceSlice(start_s=9.0, duration_s=8.0)
    assert [r.timestamp_ms for r in mooncake.history(records, trace, 7.0)] == [2000, 3000, 8999]
    assert mooncake.history(records, trace, 0.0) == []
    with pytest.raises(ValueError, match="history must be >= 0"):
        mooncake.history(records, trace, -1.0)


def test_the_slice_takes_its_window_in_time_order_and_scales_the_times():
    records = [TraceRecord(timestamp_ms=t, input_length=10, output_length=1, hash_ids=(0,))
               for t in (9000, 1000, 3000, 2000, 12000)]
    trace = TraceSlice(start_s=1.5, duration_s=8.0, max_requests=2, time_scale=0.5)
    chosen = mooncake.select(records, trace)
    assert [r.timestamp_ms for r in chosen] == [2000, 3000]
    assert mooncake.arrival_offsets(chosen, trace) == [0.25, 0.75]


@pytest.mark.parametrize("kwargs", [dict(tokens_per_hash=0), dict(time_scale=0), dict(start_s=-1),
                                    dict(duration_s=0), dict(max_requests=0), dict(max_output_len=0)])
def test_a_slice_out_of_range_is_refused(kwargs):
    with pytest.raises(ValueError):
        TraceSlice(**kwargs)


def test_bench_replays_a_trace_slice_with_its_ideal_hit_rate(fake_server, tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [record(0, 1100, [0, 1, 2], output=50), record(5, 1100, [0, 1, 3], output=3),
             record(10, 700, [0, 4], output=2), record(999999, 512, [9])]
    path.write_text("\n".join(json.dumps(r) for r in lines))
    server = fake_server(vocab_size=VOCAB)
    result = bench_result(["--base-url", server.base_url, "--dataset-name", "mooncake_trace", "--dataset-path",
                           str(path), "--trace-tokens-per-hash", "16", "--trace-duration", "60",
                           "--trace-max-output-len", "4", "--disable-tqdm"])
    assert result["completed"] == 3                       # the fourth is outside the slice
    assert result["input_lens"] == [34, 34, 22]           # 1100 and 700 tokens at 16 per 512
    assert result["output_lens"] == [4, 3, 2]             # capped at 4
    # ideal: the second hits ids 0, 1 (32 tokens), the third id 0 (16): 48 of 90
    assert result["ideal_prefix_cache_hit_rate"] == pytest.approx(48 / 90)
    # the two 34-token prompts (hash ids 0, 1 and then 2 or 3) share 32 tokens, the 22-token one (0, 4) the first 16;
    # the requests 5 ms apart may reach the server in either order on a busy machine
    prompts = sorted((body["prompt"] for body in server.state.bodies), key=len, reverse=True)
    assert [len(p) for p in prompts] == [34, 34, 22]
    assert prompts[0][:32] == prompts[1][:32] and prompts[0][:16] == prompts[2][:16]


def test_bench_refuses_a_trace_without_a_path():
    from hybridpd.bench.config import BenchConfig, DatasetName

    with pytest.raises(ValueError, match="needs --dataset-path"):
        BenchConfig(base_url="http://x", dataset=DatasetName.MOONCAKE_TRACE)
