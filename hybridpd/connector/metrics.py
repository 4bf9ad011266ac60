"""Connector metrics (Prometheus), registered on the node's registry.

Exposed names: `hybridpd:kv_bytes_read_total{peer}`, `hybridpd:kv_read_seconds{peer}` (histogram),
`hybridpd:kv_failed_loads_total{peer}`, `hybridpd:kv_decode_hit_tokens_total{peer}` (decode side);
`hybridpd:kv_leases_held`, `hybridpd:kv_leases_expired_total` (prefill side).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

READ_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ConnectorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.bytes_read = Counter(
            "hybridpd:kv_bytes_read", "KV bytes read from a peer", ["peer"], registry=registry
        )
        self.read_seconds = Histogram(
            "hybridpd:kv_read_seconds", "Seconds from start to end of one request's READ", ["peer"],
            buckets=READ_SECONDS_BUCKETS, registry=registry,
        )
        self.failed_loads = Counter(
            "hybridpd:kv_failed_loads", "Requests whose remote KV could not be loaded", ["peer"], registry=registry
        )
        self.decode_hit_tokens = Counter(
            "hybridpd:kv_decode_hit_tokens",
            "Prompt tokens of remotely prefilled requests served by the decode node's own prefix cache",
            ["peer"], registry=registry,
        )
        self.leases_held = Gauge("hybridpd:kv_leases_held", "Leases this node holds for remote decoders",
                                 registry=registry)
        self.leases_expired = Counter("hybridpd:kv_leases_expired", "Leases that ended by expiry, not Release",
                                      registry=registry)

    def record_read(self, peer: str, num_bytes: int, seconds: float) -> None:
        self.bytes_read.labels(peer=peer).inc(num_bytes)
        self.read_seconds.labels(peer=peer).observe(seconds)

    def record_failed_load(self, peer: str) -> None:
        self.failed_loads.labels(peer=peer).inc()

    def record_decode_hit(self, peer: str, num_tokens: int) -> None:
        self.decode_hit_tokens.labels(peer=peer).inc(num_tokens)

    def lease_acquired(self) -> None:
        self.leases_held.inc()

    def lease_released(self) -> None:
        self.leases_held.dec()

    def lease_expired(self) -> None:
        self.leases_held.dec()
        self.leases_expired.inc()
