"""What the e2e tests of cache-aware routing share: a cluster of tiny-checkpoint nodes publishing KV events behind a
proxy on `--routing cache_aware`, and reads of the proxy's and the nodes' metrics. Tests synchronise on state, never
on time: `wait_synced` waits until the proxy has applied every event batch each node published (the nodes'
`kv_event_batches_published` gauge, the proxy's `kv_event_batches`)."""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Iterator

from hybridpd.launcher.cluster import LocalCluster
from hybridpd.launcher.ports import free_cluster_ports
from hybridpd.launcher.spec import ClusterInfo, ClusterSpec, NodeInfo
from tests.e2e.nodes import NodeProcess, make_tiny_checkpoint

SYNC_TIMEOUT = 60.0
BLOCK = 16


@contextlib.contextmanager
def cache_aware_cluster(tmp_path_factory, num_prefill: int, num_decode: int,
                        proxy_args: tuple[str, ...] = ()) -> Iterator[tuple[LocalCluster, ClusterInfo]]:
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))
    proxy_port, base_port = free_cluster_ports(num_prefill + num_decode, kv_events=True)
    spec = ClusterSpec(
        num_prefill=num_prefill, num_decode=num_decode, model_dir=model, port=proxy_port, base_port=base_port,
        run_dir=tmp_path_factory.mktemp("run"), startup_timeout=240.0, stop_grace=10.0, kv_events=True,
        serve_args=("--kv-cache-memory", "64MiB", "--block-size", str(BLOCK)),
        proxy_args=("--routing", "cache_aware", "--prefill-timeout", "60", "--decode-timeout", "60", *proxy_args),
    )
    local = LocalCluster(spec)
    try:
        yield local, local.start()
    finally:
        local.stop()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def gauge(text: str, name: str, label: str | None = None) -> float | None:
    for line in text.splitlines():
        if line.startswith(name) and (label is None or f'upstream="{label}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return None


def address(node: NodeInfo) -> str:
    return f"127.0.0.1:{node.port}"


def wait_synced(info: ClusterInfo, nodes: tuple[NodeInfo, ...] | None = None) -> None:
    """Until the proxy has applied every batch each node published (and has an index of each)."""
    nodes = nodes if nodes is not None else info.prefill + info.decode
    deadline = time.monotonic() + SYNC_TIMEOUT
    while True:
        proxy = get(info.proxy_url + "/metrics")
        behind = []
        for node in nodes:
            published = gauge(get(node.metrics_url), "hybridpd:kv_event_batches_published")
            applied = gauge(proxy, "hybridpd_proxy_kv_event_batches", address(node))
            hashes = gauge(proxy, "hybridpd_proxy_kv_index_hashes", address(node))
            if published is None or applied is None or hashes is None or hashes < 0 or applied < published:
                behind.append((node.name, published, applied, hashes))
        if not behind:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the proxy did not catch up with the nodes' events: {behind}")
        time.sleep(0.1)


def calls(info: ClusterInfo, node: NodeInfo) -> float:
    """The proxy's calls to `node` so far."""
    proxy = get(info.proxy_url + "/metrics")
    for line in proxy.splitlines():
        if line.startswith("hybridpd_proxy_upstream_requests_total") and f'upstream="{address(node)}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def view(node: NodeInfo) -> NodeProcess:
    """What `assert_blocks_free` reads of a node (its metrics), for a node LocalCluster started."""
    return NodeProcess(None, node.port, node.kv_port, node.log_path)  # type: ignore[arg-type]
