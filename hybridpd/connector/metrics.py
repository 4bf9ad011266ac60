"""Connector metrics (Prometheus), registered on the node's registry.

Ours, per pull of one request (every group of it): `hybridpd:kv_bytes_read_total`, `hybridpd:kv_read_seconds`
(histogram), `hybridpd:kv_failed_loads_total`, `hybridpd:kv_decode_hit_tokens_total` (decode side);
`hybridpd:kv_leases_held`, `hybridpd:kv_leases_expired_total` (prefill side). vLLM's NIXL connector figures beside
them, under its names and buckets (hybridpd/vllm_metrics.py): `vllm:nixl_xfer_time_seconds`,
`vllm:nixl_bytes_transferred`, `vllm:nixl_num_failed_transfers` (decode side), `vllm:nixl_num_kv_expired_reqs`
(prefill side). No metric is labelled by peer: peers come and go (and a request names its own), so such labels
would grow without bound; the logs name the peer of every failure.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hybridpd import vllm_metrics as vm

READ_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ConnectorMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str = "model") -> None:
        labels = vm.label_values(model_name)
        self.bytes_read = Counter("hybridpd:kv_bytes_read", "KV bytes read from prefill nodes", registry=registry)
        self.read_seconds = Histogram(
            "hybridpd:kv_read_seconds", "Seconds from start to end of one request's READ",
            buckets=READ_SECONDS_BUCKETS, registry=registry,
        )
        self.failed_loads = Counter("hybridpd:kv_failed_loads", "Requests whose remote KV could not be loaded",
                                    registry=registry)
        self.decode_hit_tokens = Counter(
            "hybridpd:kv_decode_hit_tokens",
            "Prompt tokens of remotely prefilled requests served by the decode node's own prefix cache",
            registry=registry,
        )
        self.leases_held = Gauge("hybridpd:kv_leases_held", "Leases this node holds for remote decoders",
                                 registry=registry)
        self.leases_expired = Counter("hybridpd:kv_leases_expired", "Leases that ended by expiry, not Release",
                                      registry=registry)
        self.nixl_xfer_time = Histogram(
            vm.NIXL_XFER_TIME, "Histogram of transfer duration for NIXL KV Cache transfers.", vm.LABELS,
            buckets=vm.NIXL_XFER_TIME_BUCKETS, registry=registry).labels(**labels)
        self.nixl_bytes = Histogram(
            vm.NIXL_BYTES_TRANSFERRED, "Histogram of bytes transferred per NIXL KV Cache transfers.", vm.LABELS,
            buckets=vm.NIXL_BYTES_BUCKETS, registry=registry).labels(**labels)
        self.nixl_failed = Counter(vm.NIXL_NUM_FAILED_TRANSFERS, "Number of failed NIXL KV Cache transfers.",
                                   vm.LABELS, registry=registry).labels(**labels)
        self.nixl_expired = Counter(
            vm.NIXL_NUM_KV_EXPIRED_REQS, "Number of requests that had their KV expire. NOTE: This metric is tracked "
            "on the P instance.", vm.LABELS, registry=registry).labels(**labels)

    def record_read(self, peer: str, num_bytes: int, seconds: float) -> None:
        self.bytes_read.inc(num_bytes)
        self.read_seconds.observe(seconds)
        self.nixl_bytes.observe(num_bytes)
        self.nixl_xfer_time.observe(seconds)

    def record_failed_load(self, peer: str) -> None:
        self.failed_loads.inc()
        self.nixl_failed.inc()

    def record_decode_hit(self, peer: str, num_tokens: int) -> None:
        self.decode_hit_tokens.inc(num_tokens)

    def lease_acquired(self) -> None:
        self.leases_held.inc()

    def lease_released(self) -> None:
        self.leases_held.dec()

    def lease_expired(self) -> None:
        self.leases_held.dec()
        self.leases_expired.inc()
        self.nixl_expired.inc()
