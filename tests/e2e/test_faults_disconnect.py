"""Fault matrix: the client goes away during the prefill, during the pull and mid-stream, and
the proxy is restarted while the nodes keep serving. 1 prefill + 1 decode node behind a real proxy process; after
each case both nodes have every block back and no lease left.

During the prefill: the prefill node is frozen (SIGSTOP) so the proxy's call to it stays in flight (its
`upstream_outstanding{role="prefill"}` gauge says so); the client leaves; the proxy cancels that call; the node,
thawed, either sees its client gone or prefills and then lets the unread lease expire. During the pull the client
talks to the decode node directly: through the proxy, the prefill answer and the pull follow each other in
milliseconds with no place to stop; the proxy's part (closing its decode call when its client leaves) is the same
as mid-stream, which goes through the proxy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.faults import (
    NODE_ARGS,
    PULLING,
    NodeSlot,
    ProxyProcess,
    StreamingClient,
    assert_clean,
    colocated_text,
    completion,
    frozen,
    metric,
    prompt,
    remote_prefill,
    scrape,
    start_all,
    start_proxy,
    stop_all,
    wait_for,
)

OUTSTANDING = "hybridpd_proxy_upstream_outstanding"


class Cluster:
    def __init__(self, prefill: NodeSlot, decode: NodeSlot, logs: Path) -> None:
        self.prefill_slot, self.decode_slot, self.logs = prefill, decode, logs
        self.proxy: ProxyProcess | None = None

    @property
    def prefill(self):
        return self.prefill_slot.get()

    @property
    def decode(self):
        return self.decode_slot.get()

    def start_proxy(self, port: int | None = None) -> ProxyProcess:
        self.proxy = start_proxy(self.prefill, self.decode, self.logs, port=port)
        return self.proxy


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    model = write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))
    logs = tmp_path_factory.mktemp("logs")
    slots = [NodeSlot(model, logs, (*NODE_ARGS, "--kv-lease-seconds", "3"), "prefill"),
             NodeSlot(model, logs, NODE_ARGS, "decode")]
    cluster = Cluster(*slots, logs)
    try:
        start_all(slots)
        cluster.start_proxy()
        yield cluster
    finally:
        if cluster.proxy is not None:
            cluster.proxy.stop()
        stop_all(slots)


def _stream(cluster: Cluster, tag: str, max_tokens: int = 3000) -> StreamingClient:
    return StreamingClient(cluster.proxy.port, "/v1/completions",
                           completion(prompt(tag), max_tokens=max_tokens, stream=True))


def _completions_served(node: Any) -> float:
    return scrape(node.url, "hybridpd:http_requests_total", 'endpoint="/v1/completions"')


def test_client_leaves_mid_stream_through_the_proxy(cluster):
    client = _stream(cluster, "mid-stream")
    client.send()
    client.read_events(3)
    assert metric(cluster.decode, "vllm:num_requests_running") == 1
    client.disconnect()
    assert_clean(cluster.prefill, cluster.decode)


def test_client_leaves_during_the_prefill(cluster):
    prefill, decode = cluster.prefill, cluster.decode
    decode_calls = _completions_served(decode)
    client = _stream(cluster, "during prefill", max_tokens=8)
    with frozen(prefill):
        client.send()
        wait_for(lambda: scrape(cluster.proxy.url, OUTSTANDING, 'role="prefill"') == 1,
                 "the proxy's prefill call to be in flight")
        client.disconnect()
        wait_for(lambda: scrape(cluster.proxy.url, OUTSTANDING, 'role="prefill"') == 0,
                 "the proxy to cancel its prefill call")
    # A barrier: the thawed node accepts and reads the abandoned request before this later one, so once this one
    # is answered, the abandoned one was either cancelled or admitted (and then holds a lease that must expire).
    assert colocated_text(prefill, completion("barrier", max_tokens=2)) != ""
    assert_clean(prefill, decode)
    assert _completions_served(decode) == decode_calls  # the decode node was never asked


def test_client_leaves_during_the_pull(cluster):
    prefill, decode = cluster.prefill, cluster.decode
    body = completion(prompt("during pull"), max_tokens=8, stream=True)
    params = remote_prefill(prefill, {**body, "stream": False})
    client = StreamingClient(decode.port, "/v1/completions", {**body, "kv_transfer_params": params})
    with frozen(prefill):
        client.send()
        wait_for(lambda: metric(decode, PULLING) == 1,
                 "the decode node to start pulling")
        client.disconnect()
    # The pull, once the prefill node answers, runs to its end (a READ is never abandoned half-way: it writes into
    # the request's blocks, which the abort keeps until then), releases the lease, then frees the blocks.
    assert_clean(prefill, decode)


def test_proxy_restarted_while_the_nodes_keep_serving(cluster):
    client = _stream(cluster, "proxy restart")
    client.send()
    client.read_events(2)
    port = cluster.proxy.port
    cluster.proxy.kill()
    client.disconnect()
    assert_clean(cluster.prefill, cluster.decode)  # the decode node saw its caller vanish and aborted
    body = completion(prompt("after the restart"))
    assert colocated_text(cluster.decode, body) != ""  # the nodes served on, without a proxy
    proxy = cluster.start_proxy(port=port)
    code, answer = proxy.post_json("/v1/completions", body)
    assert code == 200, answer
    assert answer["choices"][0]["text"] == colocated_text(cluster.decode, body)
    assert_clean(cluster.prefill, cluster.decode)
