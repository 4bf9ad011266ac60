"""/health (and vLLM's /ping, the same answer), /version, /v1/models and /metrics of the proxy."""

from __future__ import annotations

import pytest

from hybridpd import __version__
from hybridpd.api_keys import ApiKeys

from .fake_node import Behavior


@pytest.mark.parametrize("prefill, decode, status, states", [
    ([Behavior.OK], [Behavior.OK], 200, ["healthy", "healthy"]),
    ([Behavior.OK, None], [Behavior.OK], 503, ["healthy", "unreachable", "healthy"]),
    ([Behavior.OK], [None], 503, ["healthy", "unreachable"]),
])
async def test_health_lists_every_upstream(make_harness, prefill, decode, status, states):
    h = await make_harness(prefill, decode, health_timeout=1.0)
    async with h.session.get(h.url + "/health") as resp:
        assert resp.status == status
        body = await resp.json()
    assert body["status"] == ("healthy" if status == 200 else "unhealthy")
    assert [u["state"] for u in body["upstreams"]] == states
    ports = h.prefill_ports + h.decode_ports
    assert [u["address"] for u in body["upstreams"]] == [f"127.0.0.1:{p}" for p in ports]
    assert [u["role"] for u in body["upstreams"]] == ["prefill"] * len(prefill) + ["decode"] * len(decode)


async def test_health_reports_a_node_that_answers_not_ready(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    h.decode[0].health_status = 503
    async with h.session.get(h.url + "/health") as resp:
        assert resp.status == 503
        assert (await resp.json())["upstreams"][1]["state"] == "unhealthy"


@pytest.mark.parametrize("decode, status", [([Behavior.OK], 200), ([None], 502)])
async def test_models_come_from_a_decode_node(make_harness, decode, status):
    h = await make_harness([Behavior.OK], decode)
    async with h.session.get(h.url + "/v1/models") as resp:
        assert resp.status == status
        body = await resp.json()
    if status == 200:
        assert body["data"][0]["node"] == h.decode_ports[0]
    else:
        assert f"decode node 127.0.0.1:{h.decode_ports[0]}" in body["error"]["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_the_tokenizer_endpoints_are_a_decode_nodes(make_harness, path):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    body = {"tokens": [1, 2], "prompt": "héllo"}
    async with h.session.post(h.url + path, json=body) as resp:
        assert resp.status == 200
        assert await resp.json() == {"got": body, "path": path, "node": h.decode_ports[0]}
    assert h.prefill[0].received == []


async def test_a_decode_nodes_refusal_of_a_passed_call_is_passed_on(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    async with h.session.get(h.url + "/tokenizer_info") as resp:   # the fake node has no such endpoint: a 404
        assert resp.status == 404


async def test_metrics_count_requests_errors_and_latency_per_upstream(make_harness):
    h = await make_harness([None, Behavior.OK], [Behavior.OK])
    for _ in range(2):
        async with h.session.post(h.url + "/v1/completions", json={"prompt": "a"}) as resp:
            assert resp.status == 200
    async with h.session.get(h.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    down, up, dec = h.prefill_ports[0], h.prefill_ports[1], h.decode_ports[0]
    expected = [
        'hybridpd_proxy_requests_total{endpoint="/v1/completions",status="200"} 2.0',
        f'hybridpd_proxy_upstream_requests_total{{role="prefill",upstream="127.0.0.1:{up}"}} 2.0',
        f'hybridpd_proxy_upstream_requests_total{{role="decode",upstream="127.0.0.1:{dec}"}} 2.0',
        f'hybridpd_proxy_upstream_errors_total{{kind="unreachable",role="prefill",upstream="127.0.0.1:{down}"}}',
        f'hybridpd_proxy_upstream_latency_seconds_count{{role="decode",upstream="127.0.0.1:{dec}"}} 2.0',
        f'hybridpd_proxy_upstream_outstanding{{role="decode",upstream="127.0.0.1:{dec}"}} 0.0',
    ]
    for line in expected:
        assert line in text, line


def test_the_series_of_a_node_that_left_are_forgotten():
    """Nodes come and go under DNS discovery: the scrape must not grow with every node ever seen."""
    from hybridpd.proxy.config import Role, Upstream
    from hybridpd.proxy.metrics import ProxyMetrics

    metrics = ProxyMetrics()
    stay, leave = (Upstream(role=Role.DECODE, host="10.0.0.1", port=p) for p in (8100, 8101))
    for node in (stay, leave):
        metrics.count_call(node)
        metrics.count_error(node, "timeout")
        metrics.observe_latency(node, 0.1)
        metrics.count_prediction(node, 16, 16)
        metrics.set_index(node.address, 3, 1)
    metrics.retain({stay.address})
    text = metrics.render().decode()
    assert stay.address in text and leave.address not in text
    metrics.retain(set())
    assert "10.0.0.1" not in metrics.render().decode()


@pytest.mark.parametrize("decode, status", [([Behavior.OK], 200), ([None], 503)])
async def test_ping_is_health_and_version_is_ours(make_harness, decode, status):
    h = await make_harness([Behavior.OK], decode, health_timeout=1.0, api_keys=ApiKeys(("k",)))
    for method in ("GET", "POST"):
        async with h.session.request(method, h.url + "/ping") as resp:
            assert resp.status == status and (await resp.json())["status"] in ("healthy", "unhealthy")
    async with h.session.get(h.url + "/version") as resp:
        assert await resp.json() == {"version": __version__}


@pytest.mark.parametrize("body, route", [
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, "/v1/chat/completions"),
    ({"prompt": "hi", "max_tokens": 3}, "/v1/completions"),
    ({"input": "hi"}, None),
    (None, None),   # a body that is not JSON
])
async def test_invocations_goes_the_way_of_its_body(make_harness, body, route):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    kwargs = {"json": body} if body is not None else {"data": b"{"}
    async with h.session.post(h.url + "/invocations", **kwargs) as resp:
        assert resp.status == (200 if route else 400)
    assert [r.path for r in h.decode[0].received] == ([route] if route else [])
    assert [r.path for r in h.prefill[0].received] == ([route] if route else [])
