"""Nodes that fail grayer than dying: silent (stopped), hung, answering 5xx. Each is ejected from rotation after a
bounded number of failures, and the requests after that go to the healthy node."""

from __future__ import annotations

import asyncio

import pytest

from hybridpd.proxy.config import Role, RoutingPolicy
from hybridpd.proxy.outliers import NodeState, OutlierPolicy

from .fake_node import Behavior

BODY = {"prompt": "hello", "max_tokens": 4}
STREAM_BODY = {**BODY, "stream": True}
REQUESTS = 12
DEADLINE_ROUNDS = 200   # rounds of 50 ms at most (bounded waiting, never a timed assertion)
NO_PROBES = 3600.0      # the probes' interval when a test wants to see what the calls alone do


async def statuses(h, body, count=REQUESTS) -> list[int]:
    out = []
    for _ in range(count):
        async with h.session.post(h.url + "/v1/completions", json=body) as resp:
            await resp.read()
            out.append(resp.status)
    return out


@pytest.mark.parametrize("policy", ["round_robin", "least_outstanding"])
async def test_a_silent_prefill_node_costs_its_first_byte_timeout_then_is_ejected(make_harness, policy):
    h = await make_harness([Behavior.SILENT, Behavior.OK], [Behavior.OK], routing=RoutingPolicy(policy),
                           prefill_first_byte_timeout=0.2, prefill_timeout=60.0, probe_interval=NO_PROBES,
                           fallback_colocated=False)
    assert await statuses(h, BODY) == [200] * REQUESTS   # each call on the silent node was retried on the other
    router = h.proxy.routers[Role.PREFILL]
    silent = router.upstreams[0]
    assert router.outliers.state(silent) is NodeState.EJECTED
    assert "no first byte" in router.outliers.health(silent).last_error
    # at most `threshold` calls went to it before the ejection; every request reached the healthy node
    assert len(h.prefill[1].received) == REQUESTS


async def test_a_silent_node_fails_its_probes_and_is_ejected_without_any_call(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.OK, Behavior.SILENT], probe_interval=0.05, health_timeout=0.1)
    router = h.proxy.routers[Role.DECODE]
    for _ in range(DEADLINE_ROUNDS):
        if router.down:
            break
        await asyncio.sleep(0.05)
    assert router.down == frozenset({router.upstreams[1]})
    assert await statuses(h, STREAM_BODY) == [200] * REQUESTS
    async with h.session.get(h.url + "/health") as resp:
        body = await resp.json()
    assert resp.status == 503
    assert [u["routing"]["state"] for u in body["upstreams"]] == ["healthy", "healthy", "ejected"]


async def test_a_decode_node_answering_500_is_ejected_after_the_threshold(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.FAIL, Behavior.OK], probe_interval=NO_PROBES)
    threshold = OutlierPolicy().threshold
    got = await statuses(h, BODY)
    assert got.count(502) == threshold and got[-(REQUESTS - 2 * threshold):] == [200] * (REQUESTS - 2 * threshold)
    assert h.proxy.routers[Role.DECODE].down == frozenset({h.proxy.routers[Role.DECODE].upstreams[0]})
    async with h.session.get(h.url + "/metrics") as resp:
        text = await resp.text()
    assert 'hybridpd_proxy_ejections{role="decode"} 1.0' in text
    assert f'hybridpd_proxy_node_state{{role="decode",state="ejected",upstream="127.0.0.1:{h.decode_ports[0]}"}} 1.0' \
        in text


async def test_a_decode_stream_that_hangs_counts_against_its_node(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.HANG_MID_STREAM, Behavior.OK], decode_timeout=0.2,
                           probe_interval=NO_PROBES)
    await statuses(h, STREAM_BODY)
    router = h.proxy.routers[Role.DECODE]
    assert router.down == frozenset({router.upstreams[0]})
    assert len(h.decode[0].received) == OutlierPolicy().threshold


async def test_a_non_streamed_decode_call_is_bounded_by_its_own_timeout_not_the_chunk_gap(make_harness):
    """The node sends nothing until a non-streamed generation ends: the gap timeout must not cut it short."""
    h = await make_harness([Behavior.OK], [Behavior.HANG], decode_timeout=0.05, decode_request_timeout=0.5,
                           probe_interval=NO_PROBES, fallback_colocated=False)
    async with h.session.post(h.url + "/v1/completions", json=BODY) as resp:
        assert resp.status == 504
        assert (await resp.json())["error"]["type"] == "gateway_timeout"


async def test_a_silent_decode_node_never_reads_the_call_which_goes_to_the_other_node(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.SILENT, Behavior.OK], decode_first_byte_timeout=0.2,
                           probe_interval=NO_PROBES)
    assert await statuses(h, STREAM_BODY) == [200] * REQUESTS
    assert await statuses(h, BODY) == [200] * REQUESTS
    router = h.proxy.routers[Role.DECODE]
    assert router.down == frozenset({router.upstreams[0]})
    assert len(h.decode[1].received) == 2 * REQUESTS


async def test_a_prefill_call_under_way_on_a_node_that_gets_ejected_is_retried_elsewhere(make_harness):
    """The front answers (100 Continue) but its engine never does: its /health says so, the probes eject it, and
    the call waiting on it goes to the other prefill node (a prefill is idempotent until it answers)."""
    h = await make_harness([Behavior.HANG, Behavior.OK], [Behavior.OK], probe_interval=0.05, health_timeout=0.5,
                           prefill_timeout=60.0, fallback_colocated=False)
    h.prefill[0].health_status = 503
    assert await statuses(h, BODY, count=3) == [200] * 3
    assert len(h.prefill[1].received) == 3
    assert h.prefill[0].cancelled.is_set()     # the abandoned call was closed, so the node aborts it
