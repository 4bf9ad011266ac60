"""Round robin and least-outstanding order, on the router and through the proxy."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from hybridpd.proxy.config import Role, RoutingPolicy, Upstream
from hybridpd.proxy.routing import NoUpstreamError, Router

from .fake_node import Behavior

NODES = tuple(Upstream(role=Role.DECODE, host="127.0.0.1", port=9000 + i) for i in range(3))


def _run(router: Router, steps: list[tuple[str, int]]) -> list[int]:
    """Steps: ("pick", -) picks and holds the pick in flight; ("done", i) ends one call held on node i."""
    picked: list[int] = []
    held: dict[int, list[contextlib.ExitStack]] = {i: [] for i in range(len(NODES))}
    for op, arg in steps:
        if op == "pick":
            upstream = router.pick()
            index = NODES.index(upstream)
            stack = contextlib.ExitStack()
            stack.enter_context(router.in_flight(upstream))
            held[index].append(stack)
            picked.append(index)
        else:
            held[arg].pop().close()
    return picked


PICK = ("pick", 0)


@pytest.mark.parametrize("policy, steps, expected", [
    (RoutingPolicy.ROUND_ROBIN, [PICK] * 5, [0, 1, 2, 0, 1]),
    (RoutingPolicy.ROUND_ROBIN, [PICK, PICK, ("done", 0), ("done", 1), PICK, PICK], [0, 1, 2, 0]),
    (RoutingPolicy.LEAST_OUTSTANDING, [PICK] * 4, [0, 1, 2, 0]),
    # node 1 and 2 finish; node 0 still busy: the next two go to 1 and 2, then 0 ties with them again
    (RoutingPolicy.LEAST_OUTSTANDING, [PICK, PICK, PICK, ("done", 1), ("done", 2), PICK, PICK, PICK],
     [0, 1, 2, 1, 2, 0]),
    # node 0 holds two calls: least outstanding keeps avoiding it until the others catch up
    (RoutingPolicy.LEAST_OUTSTANDING, [PICK, PICK, PICK, ("done", 1), ("done", 2), PICK, PICK, PICK, PICK],
     [0, 1, 2, 1, 2, 0, 1]),
])
def test_pick_order(policy, steps, expected):
    assert _run(Router(NODES, policy), steps) == expected


def test_loads_are_read_in_the_order_of_the_upstreams_and_a_node_that_left_is_not_among_them():
    router = Router(NODES, RoutingPolicy.CACHE_AWARE)
    with router.in_flight(NODES[2], work_tokens=7), router.in_flight(NODES[0], work_tokens=3), \
            router.in_flight(NODES[2], work_tokens=1):
        assert router.loads() == ([1, 0, 2], [3, 0, 8])
        router.replace((NODES[2], NODES[1]))   # node 0 left; its call still runs and is still counted
        assert router.loads() == ([2, 0], [8, 0]) and router.outstanding(NODES[0]) == 1
        assert router.pick(costs=[5.0, 4.0]) == NODES[1] and router.pick(costs=[4.0, 4.0]) == NODES[2]
    assert router.loads() == ([0, 0], [0, 0])


@pytest.mark.parametrize("policy", list(RoutingPolicy))
def test_exclude_skips_failed_nodes_and_runs_out(policy):
    router = Router(NODES, policy)
    assert router.pick(exclude=[NODES[0], NODES[1]]) == NODES[2]
    with pytest.raises(NoUpstreamError):
        router.pick(exclude=NODES)


@pytest.mark.parametrize("policy, expected", [
    (RoutingPolicy.ROUND_ROBIN, [0, 1, 0, 1]),
    (RoutingPolicy.LEAST_OUTSTANDING, [0, 1, 0, 1]),
])
async def test_sequential_requests_spread_over_decoders(make_harness, policy, expected):
    h = await make_harness([Behavior.OK], [Behavior.OK, Behavior.OK], routing=policy)
    seen = []
    for _ in expected:
        async with h.session.post(h.url + "/v1/completions", json={"prompt": "a"}) as resp:
            seen.append(h.decode_ports.index((await resp.json())["node"]))
    assert seen == expected


async def test_least_outstanding_avoids_the_busy_decoder(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.HANG, Behavior.OK],
                           routing=RoutingPolicy.LEAST_OUTSTANDING)
    busy = asyncio.create_task(h.session.post(h.url + "/v1/completions", json={"prompt": "a"}))
    try:
        await asyncio.wait_for(h.decode[0].arrived.wait(), 10)
        for _ in range(3):  # round robin would send the second of these to the hanging node
            async with h.session.post(h.url + "/v1/completions", json={"prompt": "b"}) as resp:
                assert (await resp.json())["node"] == h.decode_ports[1]
    finally:
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
