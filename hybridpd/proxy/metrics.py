"""The proxy's Prometheus metrics, in a registry of its own (one per app, so tests can run many apps).

Series labelled by node are forgotten once the node has left the node lists (`retain`), so that nodes coming and
going under DNS discovery cannot grow the scrape without bound.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hybridpd.proxy.config import Upstream
from hybridpd.proxy.outliers import NodeState, OutlierDetector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._by_address: dict[str, set[tuple[Any, tuple[str, ...]]]] = {}   # the series each node has
        self.requests = Counter(
            "hybridpd_proxy_requests", "Client requests answered by the proxy",
            ["endpoint", "status"], registry=self.registry,
        )
        self.upstream_requests = Counter(
            "hybridpd_proxy_upstream_requests", "Calls from the proxy to a node",
            ["role", "upstream"], registry=self.registry,
        )
        self.upstream_errors = Counter(
            "hybridpd_proxy_upstream_errors", "Failed calls to a node, by failure kind (rejected = 4xx)",
            ["role", "upstream", "kind"], registry=self.registry,
        )
        self.upstream_latency = Histogram(
            "hybridpd_proxy_upstream_latency_seconds", "Duration of a call to a node (decode: until the stream ends)",
            ["role", "upstream"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.fallback_colocated = Counter(
            "hybridpd_proxy_fallback_colocated", "Requests a decode node prefilled itself because no prefill node "
            "could take them", registry=self.registry,
        )
        self.decode_alone = Counter(
            "hybridpd_proxy_decode_alone", "Requests a decode node served whole because it would compute fewer of "
            "their prompt tokens than --pd-threshold (no prefill call)", registry=self.registry,
        )
        self.upstream_outstanding = Gauge(
            "hybridpd_proxy_upstream_outstanding", "Calls in flight to a node",
            ["role", "upstream"], registry=self.registry,
        )

        self.predicted_hit_tokens = Counter(
            "hybridpd_proxy_predicted_hit_tokens", "Prefix-hit tokens cache-aware routing predicted on the node it "
            "chose", ["role", "upstream"], registry=self.registry,
        )
        self.reported_hit_tokens = Counter(
            "hybridpd_proxy_reported_hit_tokens", "Prefix-hit tokens the node reported (cached_tokens) for calls "
            "whose hit was predicted", ["role", "upstream"], registry=self.registry,
        )
        self.hit_predictions = Counter(
            "hybridpd_proxy_hit_predictions", "Predicted hits compared with the node's report: exact, over "
            "(predicted more) or under", ["role", "upstream", "outcome"], registry=self.registry,
        )

        self.kv_index_hashes = Gauge(
            "hybridpd_proxy_kv_index_hashes", "Block hashes the proxy knows a node's cache holds (all groups; -1: "
            "no index of the node)", ["upstream"], registry=self.registry,
        )
        self.kv_event_batches = Gauge(
            "hybridpd_proxy_kv_event_batches", "KV event batches applied from a node since the proxy started",
            ["upstream"], registry=self.registry,
        )

        self.node_state = Gauge(
            "hybridpd_proxy_node_state", "1 for a node's current routing state (healthy, ejected, probing), else 0",
            ["role", "upstream", "state"], registry=self.registry,
        )
        self.ejections = Gauge(
            "hybridpd_proxy_ejections", "Ejections of a role's nodes by the outlier detector since the proxy started",
            ["role"], registry=self.registry,
        )

    def set_node_states(self, upstreams: tuple[Upstream, ...], outliers: OutlierDetector) -> None:
        for upstream in upstreams:
            now = outliers.state(upstream)
            for state in NodeState:
                self._child(self.node_state, upstream.address, role=upstream.role.value, upstream=upstream.address,
                            state=state.value).set(1 if state is now else 0)
        if upstreams:
            self.ejections.labels(role=upstreams[0].role.value).set(outliers.num_ejections)

    def set_index(self, address: str, num_hashes: int | None, batches: int) -> None:
        self._child(self.kv_index_hashes, address, upstream=address).set(-1 if num_hashes is None else num_hashes)
        self._child(self.kv_event_batches, address, upstream=address).set(batches)

    def count_prediction(self, upstream: Upstream, predicted: int, reported: int) -> None:
        labels = {"role": upstream.role.value, "upstream": upstream.address}
        self._child(self.predicted_hit_tokens, upstream.address, **labels).inc(predicted)
        self._child(self.reported_hit_tokens, upstream.address, **labels).inc(reported)
        outcome = "exact" if predicted == reported else "over" if predicted > reported else "under"
        self._child(self.hit_predictions, upstream.address, **labels, outcome=outcome).inc()

    def count_fallback(self) -> None:
        self.fallback_colocated.inc()

    def count_decode_alone(self) -> None:
        self.decode_alone.inc()

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def count_call(self, upstream: Upstream) -> None:
        self._child(self.upstream_requests, upstream.address, role=upstream.role.value,
                    upstream=upstream.address).inc()

    def count_error(self, upstream: Upstream, kind: str) -> None:
        self._child(self.upstream_errors, upstream.address, role=upstream.role.value, upstream=upstream.address,
                    kind=kind).inc()

    def observe_latency(self, upstream: Upstream, seconds: float) -> None:
        self._child(self.upstream_latency, upstream.address, role=upstream.role.value,
                    upstream=upstream.address).observe(seconds)

    def set_outstanding(self, upstream: Upstream, count: int) -> None:
        self._child(self.upstream_outstanding, upstream.address, role=upstream.role.value,
                    upstream=upstream.address).set(count)

    def _child(self, metric: Any, address: str, **labels: str) -> Any:
        self._by_address.setdefault(address, set()).add((metric, tuple(labels.values())))
        return metric.labels(**labels)

    def retain(self, addresses: set[str]) -> None:
        """Forget the series of every node not in `addresses` (it left the node lists)."""
        for address in [a for a in self._by_address if a not in addresses]:
            for metric, values in self._by_address.pop(address):
                try:
                    metric.remove(*values)
                except KeyError:
                    pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
