"""Cache-aware routing with 2 prefill + 2 decode nodes (`LocalCluster`, nodes publishing KV events, the proxy on
`--routing cache_aware`): a node's events decode with a consumer that knows only vLLM's format; prompts that share a
prefix land on the nodes that hold it and the hits the proxy predicted are the hits the nodes report; a decode node
killed and restarted leaves the proxy's index and is indexed again from nothing; every block is back in its pool.

The test synchronises on state, never on time (tests/e2e/kv_cluster.py: `wait_synced` before each request)."""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.request
from collections.abc import Iterator

import pytest

from hybridpd.launcher.cluster import LocalCluster
from hybridpd.launcher.spec import EVENTS_PORT_OFFSET, REPLAY_PORT_OFFSET, ClusterInfo
from tests.e2e.kv_cluster import (
    BLOCK, SYNC_TIMEOUT, address, cache_aware_cluster, calls, gauge, get, view, wait_synced,
)
from tests.e2e.nodes import assert_blocks_free
from tests.e2e.vllm_kv_events import BlockStored, VLLMSubscriber, replay


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[LocalCluster, ClusterInfo]]:
    with cache_aware_cluster(tmp_path_factory, 2, 2) as started:
        yield started


def _complete(url: str, prompt: list[int], max_tokens: int = 4) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _predictions(info: ClusterInfo) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in get(info.proxy_url + "/metrics").splitlines():
        if line.startswith("hybridpd_proxy_hit_predictions_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_a_consumer_that_knows_only_vllms_format_decodes_a_nodes_events(cluster):
    local, info = cluster
    node = info.prefill[0]
    offset = node.port - local.spec.base_port
    endpoint = f"tcp://127.0.0.1:{local.spec.base_port + EVENTS_PORT_OFFSET + offset}"
    replay_endpoint = f"tcp://127.0.0.1:{local.spec.base_port + REPLAY_PORT_OFFSET + offset}"
    groups = json.loads(get(node.url + "/kv_events"))["groups"]
    # where vLLM's own endpoint says the events are (one data-parallel rank)
    (rank, source), = json.loads(get(node.url + "/kv_event_sources")).items()
    assert (rank, source["enable_kv_cache_events"], source["publisher"], source["topic"]) == ("0", True, "zmq",
                                                                                              "kv-events")
    assert (source["endpoint"], source["replay_endpoint"]) == (endpoint, replay_endpoint)
    sub = VLLMSubscriber(endpoint, "kv-events")
    try:
        rng = random.Random(7)
        prompt = [rng.randrange(1, 200) for _ in range(3 * BLOCK + 5)]
        _complete(node.url, prompt, max_tokens=1)  # colocated on that node
        history = replay(replay_endpoint, 0)

        def offset_in_prompt(event: BlockStored) -> int | None:
            for start in range(0, len(prompt), event.block_size):
                if event.token_ids and prompt[start:start + len(event.token_ids)] == event.token_ids:
                    return start
            return None

        stored = [(e, offset_in_prompt(e)) for _, batch in history for e in batch.events
                  if isinstance(e, BlockStored) and offset_in_prompt(e) is not None]
        assert {e.group_idx for e, _ in stored} == {g["group_idx"] for g in groups}
        for event, start in stored:
            group = groups[event.group_idx]
            assert event.kv_cache_spec_kind == group["kind"] and event.block_size == group["block_size"]
            assert event.kv_cache_spec_sliding_window == group["sliding_window"]
            assert event.medium == "GPU" and (event.parent_block_hash is None) == (start == 0)
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            assert all(isinstance(h, bytes) and len(h) == 32 for h in event.block_hashes)
        seqs = [seq for seq, _ in history]
        assert seqs == list(range(len(seqs)))
        live = sub.receive(timeout_ms=100)  # the live socket numbers batches as the replay does
        assert live is None or (live[0] == "kv-events" and live[1] <= seqs[-1])
    finally:
        sub.close()


def test_shared_prefixes_land_where_they_are_cached_and_predictions_hold(cluster):
    local, info = cluster
    rng = random.Random(11)
    prefix = [rng.randrange(1, 200) for _ in range(6 * BLOCK)]
    first_decode_calls = [calls(info, n) for n in info.decode]
    wait_synced(info)
    _complete(info.proxy_url, prefix + [rng.randrange(1, 200) for _ in range(5)])
    holder = [n for n, before in zip(info.decode, first_decode_calls) if calls(info, n) > before]
    assert len(holder) == 1
    before = [calls(info, n) for n in info.decode]
    for _ in range(5):
        wait_synced(info)
        answer = _complete(info.proxy_url, prefix + [rng.randrange(1, 200) for _ in range(rng.randrange(1, 20))])
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prefix) - BLOCK
    after = [calls(info, n) for n in info.decode]
    assert [a - b for a, b in zip(after, before)] == [5 if n is holder[0] else 0 for n in info.decode]
    predictions = _predictions(info)
    assert predictions.get("exact", 0) >= 10   # 5 requests x (prefill + decode) at least, all exact
    assert predictions.get("over", 0) == 0 and predictions.get("under", 0) == 0, predictions
    for node in info.prefill + info.decode:
        assert_blocks_free(view(node))


def test_a_restarted_decode_node_is_indexed_again_from_nothing(cluster):
    local, info = cluster
    wait_synced(info)
    victim = max(info.decode, key=lambda n: gauge(get(info.proxy_url + "/metrics"),
                                                      "hybridpd_proxy_kv_index_hashes", address(n)) or 0)
    child = next(c for c in local.children if c.name == victim.name)
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + SYNC_TIMEOUT
    while gauge(get(info.proxy_url + "/metrics"), "hybridpd_proxy_kv_index_hashes", address(victim)) != -1:
        assert time.monotonic() < deadline, "the proxy kept the index of a node that stopped answering"
        time.sleep(0.1)
    local.respawn(child)
    deadline = time.monotonic() + 240
    while True:
        hashes = gauge(get(info.proxy_url + "/metrics"), "hybridpd_proxy_kv_index_hashes", address(victim))
        if hashes == 0:
            break
        assert time.monotonic() < deadline, f"the restarted node was not indexed again ({hashes})"
        time.sleep(0.2)
    rng = random.Random(13)
    for _ in range(4):   # new prefixes: each lands somewhere, the restarted node takes its share
        wait_synced(info)
        _complete(info.proxy_url, [rng.randrange(1, 200) for _ in range(3 * BLOCK)])
    wait_synced(info)
    for node in info.prefill + info.decode:
        assert_blocks_free(view(node))

