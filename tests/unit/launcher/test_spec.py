"""`hybridpd up`'s port layout and validation (ClusterSpec), and the endpoint listing it prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpd.launcher.ports import free_cluster_ports
from hybridpd.launcher.spec import ClusterInfo, ClusterSpec, NodeInfo
from hybridpd.proxy.config import Role


@pytest.mark.parametrize("num_prefill, num_decode, base, expected", [
    (1, 1, 8100, [("prefill-0", Role.PREFILL, 8100, 9100), ("decode-0", Role.DECODE, 8101, 9101)]),
    (2, 1, 7000, [("prefill-0", Role.PREFILL, 7000, 8000), ("prefill-1", Role.PREFILL, 7001, 8001),
                  ("decode-0", Role.DECODE, 7002, 8002)]),
])
def test_node_ports_follow_the_base_port(num_prefill, num_decode, base, expected):
    spec = ClusterSpec(num_prefill=num_prefill, num_decode=num_decode, base_port=base, port=6000)
    assert list(spec.nodes()) == expected


@pytest.mark.parametrize("kwargs, message", [
    ({"num_prefill": 0}, "must be >= 1"),
    ({"num_decode": 0}, "must be >= 1"),
    ({"threads": 0}, "--threads"),
    ({"port": 8101, "base_port": 8100}, "collides"),
    ({"port": 9100, "base_port": 8100}, "collides"),
    ({"base_port": 64999}, "no room"),
    ({"startup_timeout": 0}, "positive"),
])
def test_bad_specs_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClusterSpec(**kwargs)


def test_free_cluster_ports_are_distinct_from_each_other():
    proxy, base = free_cluster_ports(3)
    spec = ClusterSpec(num_prefill=2, num_decode=1, port=proxy, base_port=base)
    ports = [proxy] + [p for _, _, http, kv in spec.nodes() for p in (http, kv)]
    assert len(set(ports)) == len(ports) == 7


def test_describe_lists_every_endpoint_and_metrics_url():
    node = NodeInfo(name="decode-0", role=Role.DECODE, url="http://127.0.0.1:8101", port=8101, kv_port=9101,
                    pid=1, log_path=Path("/tmp/x.log"))
    info = ClusterInfo(proxy_url="http://127.0.0.1:8000", proxy_pid=2, proxy_log_path=Path("/tmp/p.log"),
                       prefill=(), decode=(node,), run_dir=Path("/tmp/run"))
    text = info.describe()
    for expected in ("http://127.0.0.1:8000", "decode-0", "http://127.0.0.1:8101/metrics", ":9101", "/tmp/run"):
        assert expected in text
    assert ("hybridpd bench --base-url http://127.0.0.1:8000 --metrics-url http://127.0.0.1:8101/metrics"
            in text.splitlines()[-1])

