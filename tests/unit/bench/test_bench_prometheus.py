"""Summing the KV-bytes counter over Prometheus text pages, and the before/after delta."""

from __future__ import annotations

import pytest

from hybridpd.bench.prometheus import KV_BYTES_READ_METRIC, counter_delta, counter_sum

PAGE = """\
# HELP hybridpd:kv_bytes_read_total Bytes of KV read from peers
# TYPE hybridpd:kv_bytes_read_total counter
hybridpd:kv_bytes_read_total{peer="10.0.0.1:5600"} 1024.0
hybridpd:kv_bytes_read_total{peer="we ird} \\"peer\\"",engine="e 1"} 1.5e3 1712345678000
hybridpd:kv_bytes_read_created{peer="10.0.0.1:5600"} 1.7e9
hybridpd:kv_bytes_read_total_other 99
hybridpd:kv_bytes_read_total 10
other_metric{x="hybridpd:kv_bytes_read_total"} 5
"""


@pytest.mark.parametrize(
    "text, expected",
    [
        (PAGE, 1024.0 + 1500.0 + 10.0),
        ("hybridpd:kv_bytes_read_total 0\n", 0.0),
        ("# only comments\nprocess_cpu_seconds_total 3\n", None),
        ("", None),
        ("hybridpd:kv_bytes_read_total{peer=\"a\"} NaN\n", None),
        # declared but no label set used yet (a decode node before its first pull): 0, not missing
        ("# HELP hybridpd:kv_bytes_read_total h\n# TYPE hybridpd:kv_bytes_read_total counter\n", 0.0),
        ("# TYPE hybridpd:kv_bytes_read counter\n", 0.0),
        ("# TYPE hybridpd:kv_bytes_read_seconds histogram\n", None),
        ("# HELP hybridpd:kv_bytes_read_total only a help line\n", None),
    ],
)
def test_counter_sum(text, expected):
    assert counter_sum(text, KV_BYTES_READ_METRIC) == expected


@pytest.mark.parametrize(
    "before, after, expected",
    [
        ((100.0, 50.0), (400.0, 70.0), 320.0),
        ((100.0, None), (400.0, 70.0), 300.0),         # a page without the counter before: left out
        ((None, None), (None, None), None),
        ((), (), None),
    ],
)
def test_counter_delta(before, after, expected):
    assert counter_delta(before, after) == expected
