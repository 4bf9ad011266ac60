"""Arrivals, flag parsing and report naming/formatting."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pytest

from hybridpd.bench import main
from hybridpd.bench.arrivals import arrival_offsets
from hybridpd.bench.config import EndpointKind, config_from_args, parse_goodput
from hybridpd.bench.metrics import compute_metrics
from hybridpd.bench.report import format_table, percentile_word, result_path


def config_for(argv: list[str]):
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


@pytest.mark.parametrize("rate, burstiness", [(10.0, 1.0), (4.0, 0.3), (50.0, 5.0)])
def test_arrivals_keep_the_offered_load(rate, burstiness):
    offsets = arrival_offsets(20, request_rate=rate, burstiness=burstiness, rng=np.random.default_rng(1))
    assert len(offsets) == 20 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1] == pytest.approx(20 / rate)
    again = arrival_offsets(20, request_rate=rate, burstiness=burstiness, rng=np.random.default_rng(1))
    assert offsets == again


@pytest.mark.parametrize(
    "rate, burstiness, expected",
    [(math.inf, 1.0, [0.0, 0.0, 0.0]), (2.0, math.inf, [0.5, 1.0, 1.5])],
)
def test_arrivals_limits(rate, burstiness, expected):
    assert arrival_offsets(3, request_rate=rate, burstiness=burstiness, rng=np.random.default_rng(0)) == expected


@pytest.mark.parametrize(
    "pairs, expected",
    [(None, ()), (["ttft:200", "tpot:5.5"], (("ttft", 200.0), ("tpot", 5.5))), (["e2el:0"], (("e2el", 0.0),))],
)
def test_parse_goodput(pairs, expected):
    assert parse_goodput(pairs) == expected


@pytest.mark.parametrize("pairs, message", [
    (["ttft"], "KEY:VALUE"), (["ttft:x"], "KEY:VALUE"), (["itl:5"], "must be one of"), (["tpot:-1"], "non-negative"),
])
def test_parse_goodput_rejects(pairs, message):
    with pytest.raises(ValueError, match=message):
        parse_goodput(pairs)


@pytest.mark.parametrize("path, kind", [
    ("/v1/completions", EndpointKind.COMPLETIONS), ("/v1/chat/completions", EndpointKind.CHAT),
])
def test_endpoint_kind(path, kind):
    assert EndpointKind.from_path(path) is kind


@pytest.mark.parametrize(
    "argv, ignore_eos",
    [
        ([], True),
        (["--dataset-name", "prefix_repetition"], True),
        (["--no-ignore-eos"], False),
        (["--dataset-name", "custom", "--dataset-path", "x.jsonl"], False),
        (["--dataset-name", "custom", "--dataset-path", "x.jsonl", "--ignore-eos"], True),
    ],
)
def test_ignore_eos_defaults_on_for_synthetic_data(argv, ignore_eos):
    assert config_for(argv).ignore_eos is ignore_eos


@pytest.mark.parametrize(
    "argv, model, expected",
    [
        ([], "org/tiny", "openai-infqps-tiny-20250101-000000.json"),
        (["--request-rate", "4", "--max-concurrency", "8", "--label", "pd"], "m", "pd-4.0qps-concurrency8-m-20250101-000000.json"),
        (["--result-dir", "out", "--result-filename", "r.json"], "m", "out/r.json"),
        (["--endpoint", "/v1/chat/completions"], "m", "openai-chat-infqps-m-20250101-000000.json"),
    ],
)
def test_result_path_follows_vllm_naming(argv, model, expected):
    assert result_path(config_for(argv), model_id=model, date="20250101-000000") == Path(expected)


@pytest.mark.parametrize("p, word", [(99.0, "99"), (50.0, "50"), (99.9, "99.9")])
def test_percentile_word(p, word):
    assert percentile_word(p) == word


def test_table_lines_have_vllm_widths():
    config = config_for(["--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9",
                         "--max-concurrency", "4", "--request-rate", "2"])
    metrics = compute_metrics([], duration_s=2.0, percentiles=config.metric_percentiles)
    lines = format_table(metrics, config, 2.0)
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert lines[-1] == "=" * 50
    assert f"{'Successful requests:':<40} {0:<10}" in lines
    assert f"{'Maximum request concurrency:':<40} {4:<10}" in lines
    assert f"{'Request rate configured (RPS):':<40} {2.0:<10.2f}" in lines
    assert f"{'Prefix cache hit rate:':<40} {'n/a':<10}" in lines
    assert "---------------Time to First Token----------------" in lines
    assert "----------------End-to-end Latency----------------" in lines
    assert f"{'P99.9 E2EL (ms):':<40} {0.0:<10.2f}" in lines
    assert not any("ITL" in line or "TPOT" in line for line in lines)


def test_sampling_flags_are_sent_only_when_given():
    assert config_for([]).sampling == ()
    config = config_for(["--temperature", "0.5", "--min-p", "0.1", "--repetition-penalty", "1.2",
                         "--presence-penalty", "-0.5", "--frequency-penalty", "0.25", "--top-k", "5"])
    assert dict(config.sampling) == {"temperature": 0.5, "min_p": 0.1, "repetition_penalty": 1.2,
                                     "presence_penalty": -0.5, "frequency_penalty": 0.25, "top_k": 5}
