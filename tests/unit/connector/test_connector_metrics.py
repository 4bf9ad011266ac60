"""Connector metrics: the names others scrape (ours per pull, vLLM's NIXL ones beside them), never labelled by peer."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from hybridpd.connector.metrics import ConnectorMetrics

VLLM = {"model_name": "m", "engine": "0"}
READS = [("record_read", "p:1", 100, 0.002), ("record_read", "p:2", 50, 0.2)]
EXPIRY = [("lease_acquired",), ("lease_expired",)]


@pytest.mark.parametrize(
    "actions, sample, labels, expected",
    [
        (READS, "hybridpd:kv_bytes_read_total", {}, 150.0),
        (READS, "hybridpd:kv_read_seconds_count", {}, 2.0),
        ([READS[0]], "hybridpd:kv_read_seconds_bucket", {"le": "0.001"}, 0.0),
        (READS, "vllm:nixl_bytes_transferred_sum", VLLM, 150.0),
        (READS, "vllm:nixl_xfer_time_seconds_count", VLLM, 2.0),
        ([READS[0]], "vllm:nixl_xfer_time_seconds_bucket", {**VLLM, "le": "0.005"}, 1.0),
        ([("record_failed_load", "p:2"), ("record_failed_load", "p:3")], "hybridpd:kv_failed_loads_total", {}, 2.0),
        ([("record_failed_load", "p:2")], "vllm:nixl_num_failed_transfers_total", VLLM, 1.0),
        ([("record_decode_hit", "p:1", 1024)], "hybridpd:kv_decode_hit_tokens_total", {}, 1024.0),
        ([("lease_acquired",), ("lease_acquired",), ("lease_released",)], "hybridpd:kv_leases_held", {}, 1.0),
        (EXPIRY, "hybridpd:kv_leases_held", {}, 0.0),
        (EXPIRY, "hybridpd:kv_leases_expired_total", {}, 1.0),
        (EXPIRY, "vllm:nixl_num_kv_expired_reqs_total", VLLM, 1.0),
    ],
)
def test_metrics(actions, sample: str, labels: dict[str, str], expected: float) -> None:
    registry = CollectorRegistry()
    metrics = ConnectorMetrics(registry, "m")
    for name, *args in actions:
        getattr(metrics, name)(*args)
    assert registry.get_sample_value(sample, labels) == expected
