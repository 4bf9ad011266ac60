"""`hybridpd replay` as a user runs it: a JSON line with the figures, or a clear message and exit code 2."""

from __future__ import annotations

import json

import pytest
import torch

from hybridpd.cli import main
from hybridpd.presets.checkpoints import write_checkpoint

TRACE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [0, 1]},
    {"timestamp": 500, "input_length": 1536, "output_length": 8, "hash_ids": [0, 1, 2]},
    {"timestamp": 900, "input_length": 600, "output_length": 3, "hash_ids": [5, 6]},
    {"timestamp": 1500, "input_length": 2048, "output_length": 8, "hash_ids": [0, 1, 2, 3]},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in TRACE))
    return path


@pytest.mark.parametrize("shape", [["--prefill", "1", "--decode", "2"], ["--colocated", "2"]])
@pytest.mark.parametrize("routing", ["round_robin", "cache_aware"])
def test_a_run_prints_its_figures(tiny, trace, shape, routing, capsys):
    code = main(["replay", str(trace), "--model", str(tiny), "--kv-cache-memory", "4MiB", "--max-model-len", "512",
                 "--trace-tokens-per-hash", "64", "--routing", routing, *shape])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert result["requests"] == 4 and result["output_tokens"] == 27
    assert 0 < result["decode_hit_rate"] <= result["ideal_hit_rate"]   # the repeated prefixes hit, no more
    assert result["mean_ttft_s"] > 0 and result["routing_decisions_per_s"] > 0


@pytest.mark.parametrize("shape", [["--prefill", "1", "--decode", "2"], ["--colocated", "2"]])
def test_a_storage_tier_serves_what_memory_lost(tiny, trace, shape, capsys):
    def run(*extra: str) -> dict:
        assert main(["replay", str(trace), "--model", str(tiny), "--kv-cache-memory", "1MiB", "--max-model-len",
                     "512", "--max-num-seqs", "1", "--trace-tokens-per-hash", "64", *shape, *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    without, tiered = run(), run("--kv-offload-size", "1GiB")
    assert without["storage"] is None and without["decode_storage_hit_rate"] is None
    assert tiered["storage"]["blocks_written"] > 0 and tiered["storage"]["blocks_evicted"] == 0
    assert tiered["decode_storage_hit_rate"] > 0
    assert without["decode_hit_rate"] < tiered["decode_hit_rate"] <= tiered["ideal_hit_rate"]


@pytest.mark.parametrize("shape", [["--prefill", "1", "--decode", "2"], ["--colocated", "2"]])
def test_a_history_fills_the_caches_and_is_not_measured(tiny, trace, shape, capsys):
    """The slice from 0.5 s: three requests; with a second of history the first request (ids 0, 1) is served
    before it, so the next one's prefix is already cached; every figure is the three's."""
    def run(*extra: str) -> dict:
        assert main(["replay", str(trace), "--model", str(tiny), "--kv-cache-memory", "4MiB", "--max-model-len",
                     "512", "--trace-tokens-per-hash", "64", "--trace-start", "0.5", "--routing", "cache_aware", *shape,
                     *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    cold, warm = run(), run("--trace-history", "1")
    assert cold["history_requests"] == 0 and warm["history_requests"] == 1
    assert cold["requests"] == warm["requests"] == 3 and cold["output_tokens"] == warm["output_tokens"] == 19
    assert cold["prompt_tokens"] == warm["prompt_tokens"]
    assert warm["ideal_hit_rate"] > cold["ideal_hit_rate"]
    assert cold["decode_hit_rate"] < warm["decode_hit_rate"] <= warm["ideal_hit_rate"]


@pytest.mark.parametrize("args, message", [
    (["--colocated", "1", "--trace-history", "-1"], "history must be >= 0"),
    (["--colocated", "2", "--prefill", "1"], "--colocated and --prefill/--decode exclude each other"),
    (["--prefill", "1"], "give --prefill and --decode"),
    (["--colocated", "1", "--kv-cache-memory", "64KiB"], "--kv-cache-memory"),
    (["--prefill", "1", "--decode", "1", "--pd-threshold", "64"], "--pd-threshold needs --routing cache_aware"),
    (["--prefill", "1", "--decode", "1", "--routing", "cache_aware", "--pd-threshold", "-1"],
     "--pd-threshold must be >= 0"),
])
def test_bad_runs_say_why(tiny, trace, args, message, capsys):
    assert main(["replay", str(trace), "--model", str(tiny), "--max-model-len", "512", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_trace_line_is_named(tiny, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(TRACE[0]) + "\n{not json\n")
    assert main(["replay", str(path), "--model", str(tiny), "--colocated", "1"]) == 2
    assert "bad.jsonl:2: not JSON" in capsys.readouterr().err


def test_a_storage_tier_of_no_size_is_refused(tiny, trace, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["replay", str(trace), "--model", str(tiny), "--colocated", "1", "--kv-offload-size", "0"])
    assert exit_.value.code == 2 and "--kv-offload-size: not a positive size" in capsys.readouterr().err


def test_saving_every_mamba_state_lets_a_prefix_hit_go_further(tiny, tmp_path, capsys):
    """The nodes' `--mamba-cache-retention`: the second request shares 3 of the first's 8 blocks of prompt; with a
    few chosen states saved its hit ends at an earlier one, with every interval's state at the shared prefix."""
    path = tmp_path / "shared.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in (
        {"timestamp": 0, "input_length": 4096, "output_length": 4, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7]},
        {"timestamp": 500, "input_length": 2048, "output_length": 4, "hash_ids": [0, 1, 2, 9]})))

    def hit_rate(retention: str) -> float:
        assert main(["replay", str(path), "--model", str(tiny), "--kv-cache-memory", "4MiB", "--max-model-len", "512",
                     "--trace-tokens-per-hash", "40", "--colocated", "1", "--mamba-cache-retention", retention]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["decode_hit_rate"]

    assert 0 < hit_rate("sparse") < hit_rate("every")


def test_a_turn_its_decode_node_holds_is_served_there_alone(tiny, tmp_path, capsys):
    """`--pd-threshold 100` at 64 tokens per hash id: the first prompt (64 tokens) is a miss below it, served whole by
    the decode node; the second extends it by 64 tokens, which that node alone would compute (it holds the first
    prompt, its Mamba state included), so it is served there too; the third, 192 new tokens, goes through the prefill
    node. Without the threshold every request does."""
    path = tmp_path / "turns.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in (
        {"timestamp": 0, "input_length": 512, "output_length": 4, "hash_ids": [0]},
        {"timestamp": 500, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1]},
        {"timestamp": 900, "input_length": 1536, "output_length": 4, "hash_ids": [5, 6, 7]})))

    def run(threshold: int) -> dict:
        assert main(["replay", str(path), "--model", str(tiny), "--kv-cache-memory", "4MiB", "--max-model-len", "512",
                     "--trace-tokens-per-hash", "64", "--prefill", "1", "--decode", "1", "--routing", "cache_aware",
                     "--pd-threshold", str(threshold)]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    disaggregated, alone = run(0), run(100)
    assert disaggregated["decode_alone_requests"] == 0 and alone["decode_alone_requests"] == 2
    assert alone["prefill_hit_rate"] == 0   # only the miss reached the prefill node
    assert alone["decode_hit_rate"] == 64 / 384   # the second prompt's first 64 tokens, found on the decode node
    assert alone["output_tokens"] == disaggregated["output_tokens"] == 12
