"""Connector metrics: the names others scrape, labelled by peer."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from hybridpd.connector.metrics import ConnectorMetrics


@pytest.mark.parametrize(
    "actions, sample, labels, expected",
    [
        ([("record_read", "p:1", 100, 0.002), ("record_read", "p:1", 50, 0.2)], "hybridpd:kv_bytes_read_total",
         {"peer": "p:1"}, 150.0),
        ([("record_read", "p:1", 100, 0.002), ("record_read", "p:1", 50, 0.2)], "hybridpd:kv_read_seconds_count",
         {"peer": "p:1"}, 2.0),
        ([("record_read", "p:1", 100, 0.002)], "hybridpd:kv_read_seconds_bucket", {"peer": "p:1", "le": "0.001"}, 0.0),
        ([("record_failed_load", "p:2"), ("record_failed_load", "p:2")], "hybridpd:kv_failed_loads_total",
         {"peer": "p:2"}, 2.0),
        ([("record_decode_hit", "p:1", 1024)], "hybridpd:kv_decode_hit_tokens_total", {"peer": "p:1"}, 1024.0),
        ([("lease_acquired",), ("lease_acquired",), ("lease_released",)], "hybridpd:kv_leases_held", {}, 1.0),
        ([("lease_acquired",), ("lease_expired",)], "hybridpd:kv_leases_held", {}, 0.0),
        ([("lease_acquired",), ("lease_expired",)], "hybridpd:kv_leases_expired_total", {}, 1.0),
    ],
)
def test_metrics(actions, sample: str, labels: dict[str, str], expected: float) -> None:
    registry = CollectorRegistry()
    metrics = ConnectorMetrics(registry)
    for name, *args in actions:
        getattr(metrics, name)(*args)
    assert registry.get_sample_value(sample, labels) == expected
