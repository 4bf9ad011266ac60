"""vLLM's metric arithmetic on hand-made timings."""

from __future__ import annotations

import math

import pytest

from hybridpd.bench.client import RequestOutput
from hybridpd.bench.metrics import (
    compute_metrics,
    count_good,
    hit_rate,
    latency_stats,
    peak_concurrency,
    tpot_seconds,
)


def out(*, start=0.0, ttft=0.0, itl=(), latency=0.0, output_len=1, prompt_len=10, cached=None, success=True):
    return RequestOutput(
        success=success, prompt_len=prompt_len, output_len=output_len, ttft=ttft, itl=tuple(itl),
        latency=latency, start_time=start, cached_tokens=cached, error="" if success else "boom",
    )


A = out(start=0.0, ttft=0.1, itl=(0.02, 0.03, 0.05), latency=0.2, output_len=4, prompt_len=10, cached=5)
B = out(start=0.05, ttft=0.3, itl=(0.1,), latency=0.4, output_len=2, prompt_len=20, cached=0)
C = out(start=0.1, ttft=0.05, latency=0.05, output_len=1, prompt_len=30)
FAILED = out(start=0.0, prompt_len=99, output_len=0, success=False)
OUTPUTS = [A, B, C, FAILED]


@pytest.mark.parametrize(
    "output, expected",
    [(A, (0.2 - 0.1) / 3), (B, 0.1), (C, None), (out(output_len=0), None)],
)
def test_tpot_is_time_after_first_token_over_remaining_tokens(output, expected):
    assert tpot_seconds(output) == (None if expected is None else pytest.approx(expected))


def test_totals_and_throughputs_are_over_successful_requests_and_duration():
    m = compute_metrics(OUTPUTS, duration_s=2.0, percentiles=[99])
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 60, 7)
    assert m.output_lens == (4, 2, 1, 0)
    assert m.request_throughput == pytest.approx(3 / 2.0)
    assert m.output_throughput == pytest.approx(7 / 2.0)
    assert m.total_token_throughput == pytest.approx(67 / 2.0)
    assert m.request_goodput is None


@pytest.mark.parametrize(
    "metric, mean, median, std",
    [
        ("ttft", 150.0, 100.0, math.sqrt(((100 - 150) ** 2 + (300 - 150) ** 2 + (50 - 150) ** 2) / 3)),
        ("tpot", (100 / 3 + 100) / 2, (100 / 3 + 100) / 2, (100 - 100 / 3) / 2),
        ("itl", 50.0, 40.0, math.sqrt(950.0)),               # pooled gaps 20, 30, 50, 100 ms
        ("e2el", 650 / 3, 200.0, math.sqrt(((200 - 650 / 3) ** 2 + (400 - 650 / 3) ** 2 + (50 - 650 / 3) ** 2) / 3)),
    ],
)
def test_mean_median_std_per_metric(metric, mean, median, std):
    stats = compute_metrics(OUTPUTS, duration_s=1.0, percentiles=[50]).stats(metric)
    assert (stats.mean_ms, stats.median_ms, stats.std_ms) == pytest.approx((mean, median, std))


@pytest.mark.parametrize(
    "values_ms, percentile, expected_ms",
    [
        ([20, 30, 50, 100], 0, 20.0),
        ([20, 30, 50, 100], 25, 27.5),        # numpy's linear interpolation: index 0.75
        ([20, 30, 50, 100], 50, 40.0),
        ([20, 30, 50, 100], 99, 50 + 0.97 * 50),
        ([20, 30, 50, 100], 100, 100.0),
        ([], 99, 0.0),                          # no samples count as [0], as in vLLM
    ],
)
def test_percentiles_interpolate_like_numpy(values_ms, percentile, expected_ms):
    stats = latency_stats([v / 1000 for v in values_ms], [percentile])
    assert stats.percentiles_ms == ((float(percentile), pytest.approx(expected_ms)),)


@pytest.mark.parametrize(
    "slos, good",
    [
        ((("ttft", 100.0),), 2),                                    # A at exactly 100 ms passes, B fails
        ((("tpot", 50.0),), 2),                                     # C's single token counts as TPOT 0
        ((("e2el", 100.0),), 1),
        ((("ttft", 1000.0), ("tpot", 40.0)), 2),
        ((("ttft", 1000.0), ("tpot", 40.0), ("e2el", 150.0)), 1),
        ((("ttft", 0.0),), 0),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    assert count_good(OUTPUTS, slos) == good
    m = compute_metrics(OUTPUTS, duration_s=4.0, percentiles=[99], goodput_slos_ms=slos)
    assert m.request_goodput == pytest.approx(good / 4.0)


@pytest.mark.parametrize(
    "outputs, expected",
    [
        ([A, B, C], 5 / 60),
        ([A], 0.5),
        ([C], None),                                   # no answer reported cached tokens
        ([out(prompt_len=0, cached=0)], None),
    ],
)
def test_prefix_cache_hit_rate_is_cached_over_prompt_tokens(outputs, expected):
    assert hit_rate(outputs) == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    "intervals, peak",
    [
        ([(0.0, 0.2), (0.05, 0.4), (0.1, 0.05)], 3),
        ([(0.0, 1.0), (1.0, 1.0), (2.0, 1.0)], 1),      # [start, end) intervals that only touch
        ([(0.0, 3.0), (1.0, 0.5), (2.0, 0.5)], 2),
        ([], 0),
    ],
)
def test_peak_concurrency_sweeps_half_open_intervals(intervals, peak):
    assert peak_concurrency([out(start=s, latency=d) for s, d in intervals]) == peak


def test_peak_output_tokens_and_kv_bytes():
    m = compute_metrics(OUTPUTS, duration_s=1.0, percentiles=[99], kv_bytes_read=1234.0)
    assert m.max_output_tokens_per_s == 7.0      # every token chunk of A, B, C lands in the first second
    assert m.max_concurrent_requests == 3
    assert m.kv_bytes_read == 1234


def test_zero_duration_is_rejected():
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(OUTPUTS, duration_s=0.0, percentiles=[99])
