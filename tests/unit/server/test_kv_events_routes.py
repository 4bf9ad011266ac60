"""The node's KV event routes: ours (`/kv_events`) and vLLM's `/kv_event_sources`, for a node that publishes and one
that does not."""

from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from hybridpd.kv_events.config import KVEventsConfig
from hybridpd.server.errors import error_middleware
from hybridpd.server.kv_events_routes import kv_events_routes

PUBLISHING = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                                  '"replay_endpoint": "tcp://*:5558", "topic": "kv", "hwm": 10}')


async def _get(config: KVEventsConfig, path: str) -> tuple[int, object]:
    app = web.Application(middlewares=[error_middleware])
    app.add_routes(kv_events_routes(config, (), host="10.1.2.3", instance_id="i", reset_prefix_cache=lambda: None,
                                    cluster_token=None))
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        resp = await client.get(path)
        return resp.status, await resp.json() if resp.content_type == "application/json" else None
    finally:
        await client.close()


async def test_kv_event_sources_is_vllms_config_per_rank_with_reachable_endpoints():
    status, body = await _get(PUBLISHING, "/kv_event_sources")
    assert status == 200
    assert body == {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://10.1.2.3:5557",
                          "replay_endpoint": "tcp://10.1.2.3:5558", "buffer_steps": 10_000, "hwm": 10,
                          "max_queue_size": 100_000, "topic": "kv"}}
    status, ours = await _get(PUBLISHING, "/kv_events")
    assert (ours["endpoint"], ours["replay_endpoint"]) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")


async def test_a_node_that_publishes_nothing_has_no_sources():
    assert await _get(KVEventsConfig(), "/kv_event_sources") == (200, {})
    status, _ = await _get(KVEventsConfig(), "/kv_events")
    assert status == 404
