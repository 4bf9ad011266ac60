"""`--kv-events-config` parsing (vLLM's field names and defaults) and the publisher's promise to the engine thread:
`publish` never blocks, a full queue drops and counts."""

from __future__ import annotations

import os
import threading

import pytest
import zmq

from hybridpd.engine.kv_cache.events import BlockRemoved
from hybridpd.kv_events.config import KVEventsConfig
from hybridpd.kv_events.publisher import ZmqEventPublisher
from hybridpd.kv_events.wire import seq_of


@pytest.mark.parametrize("text, publishes", [
    (None, False),
    ('{"enable_kv_cache_events": true}', True),                         # vLLM: publisher defaults to zmq
    ('{"enable_kv_cache_events": true, "publisher": "null"}', False),
    ('{"enable_kv_cache_events": false, "publisher": "zmq"}', False),
])
def test_parse(text, publishes):
    assert KVEventsConfig.parse(text).publishes is publishes


@pytest.mark.parametrize("text, message", [
    ("{", "not JSON"),
    ("[]", "JSON object"),
    ('{"enable_kv_cache_events": true, "bogus": 1}', "unknown field"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be bool"),
    ('{"buffer_steps": 0}', "buffer_steps must be >= 1"),
    ('{"publisher": "kafka"}', "publisher must be"),
    ('{"endpoint": "localhost:5557"}', "ZMQ address"),
    ('{"hwm": 1.5}', "hwm must be int"),
])
def test_bad_configs_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.parse(text)


def test_publish_never_blocks_and_counts_what_it_drops():
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="inproc://never-read",
                            max_queue_size=2)
    publisher = ZmqEventPublisher(config, ())
    stalled = threading.Event()
    try:
        # hold the publisher thread: no batch leaves the queue while we fill it
        original = publisher._queue.get_nowait
        publisher._queue.get_nowait = lambda: (stalled.wait(), original())[1]
        for _ in range(50):
            publisher.publish([BlockRemoved(group_idx=0, block_hashes=(b"x" * 32,))])
        assert publisher.dropped >= 47   # at most 2 queued and 1 taken by the stalled thread
    finally:
        stalled.set()
        publisher.close()


def test_every_batch_is_sent_in_order_as_it_is_published():
    """The publisher thread sleeps until a batch is queued (no timed poll): each one published after a pause, and a
    burst, must still reach a subscriber, numbered in order."""
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://in-order")
    publisher = ZmqEventPublisher(config, ())
    sub = publisher._ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect("inproc://in-order")
        seen = []
        for burst in (1, 1, 5, 1):
            for _ in range(burst):
                publisher.publish([BlockRemoved(group_idx=0, block_hashes=(b"x" * 32,))])
            for _ in range(burst):
                assert sub.poll(10_000), "a published batch never left the publisher"
                seen.append(seq_of(sub.recv_multipart()[1]))
        assert seen == list(range(8))
    finally:
        sub.close(linger=0)
        publisher.close()


def test_close_leaves_no_descriptor_open():
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://closing"), ())
        publisher.publish([BlockRemoved(group_idx=0, block_hashes=(b"x" * 32,))])
        publisher.close()
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("endpoint, host, listens", [
    ("tcp://*:{port}", "127.0.0.1", "tcp://127.0.0.1:{port}"),   # `hybridpd up --host 127.0.0.1`
    ("tcp://*:{port}", "localhost", "tcp://127.0.0.1:{port}"),
    ("tcp://*:{port}", "0.0.0.0", "tcp://0.0.0.0:{port}"),       # a node told to listen everywhere
])
def test_a_wildcard_endpoint_listens_on_the_nodes_host_only(endpoint, host, listens):
    """The events carry every block's token ids: a node on loopback must not publish them to the network."""
    import socket as sockets

    with sockets.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint.format(port=port))
    publisher = ZmqEventPublisher(config, [], host)
    try:
        assert publisher._pub.getsockopt_string(zmq.LAST_ENDPOINT) == listens.format(port=port)
    finally:
        publisher.close()
