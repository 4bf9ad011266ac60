"""A node that cannot be reached is routed around until a probe of its /health passes again."""

from __future__ import annotations

import asyncio

from hybridpd.proxy.config import Role, RoutingPolicy, Upstream
from hybridpd.proxy.outliers import OutlierDetector, OutlierPolicy
from hybridpd.proxy.routing import Router

from .fake_node import Behavior, FakeNode

DEADLINE_ROUNDS = 200  # rounds of 50 ms at most (bounded waiting, never a timed assertion)
BODY = {"prompt": "hello", "max_tokens": 2}


def test_pick_skips_ejected_nodes_unless_all_are():
    a, b = (Upstream(role=Role.DECODE, host="127.0.0.1", port=p) for p in (8201, 8202))
    now = [0.0]
    router = Router((a, b), RoutingPolicy.ROUND_ROBIN,
                    outliers=OutlierDetector(OutlierPolicy(threshold=1, base_ejection_s=10, max_ejection_s=10),
                                             clock=lambda: now[0]))
    router.outliers.call_failed(a, "refused")
    assert [router.pick() for _ in range(3)] == [b, b, b]
    router.outliers.call_failed(b, "refused")
    assert {router.pick() for _ in range(2)} == {a, b}   # all ejected: still try (one may be back)
    now[0] = 11.0
    router.outliers.probe_passed(a)
    assert router.pick() == a and router.down == frozenset({b})


async def test_an_unreachable_decode_node_is_routed_around_then_comes_back(make_harness):
    h = await make_harness([Behavior.OK], [None, Behavior.OK], connect_timeout=1.0, probe_interval=0.05)
    statuses = []
    for _ in range(4):
        async with h.session.post(h.url + "/v1/completions", json=BODY) as resp:
            statuses.append(resp.status)
    assert statuses == [200] * 4   # the call that found it down went to the other decode node (nothing was sent)
    router = h.proxy.routers[Role.DECODE]
    assert {u.port for u in router.down} == {h.decode_ports[0]}
    revived = FakeNode()
    await revived.start(port=h.decode_ports[0])                    # the node is back on its port
    try:
        for _ in range(DEADLINE_ROUNDS):
            if not router.down:
                break
            await asyncio.sleep(0.05)
        assert not router.down, "the probes did not bring the node back"
        for _ in range(4):
            async with h.session.post(h.url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 200
        assert len(revived.received) == 2                          # round robin includes it again
    finally:
        await revived.stop()
