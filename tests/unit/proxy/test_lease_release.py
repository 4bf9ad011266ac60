"""When no decode node takes a prefilled request, the proxy releases the prefill node's lease at once, rather than
leave its blocks pinned until the lease expires; once a decode node has the request, the lease is its business."""

from __future__ import annotations

import asyncio

import pytest

from .fake_node import Behavior

BODY = {"prompt": "hello", "max_tokens": 4}
DEADLINE_ROUNDS = 100   # rounds of 20 ms at most (bounded waiting, never a timed assertion)


async def releases_of(node) -> list[dict]:
    for _ in range(DEADLINE_ROUNDS):
        if node.releases:
            break
        await asyncio.sleep(0.02)
    return node.releases


@pytest.mark.parametrize("decode, stream, status", [
    ([Behavior.REJECT], False, 400),     # refused before admission (bad input, untrusted peer, missing token)
    ([Behavior.REJECT], True, 200),      # a stream whose head came from the prefill node: an error event follows
    ([None], False, 502),                # nobody listens
    ([Behavior.FAIL], False, 502),
])
async def test_a_lease_no_decode_node_took_is_released(make_harness, decode, stream, status):
    h = await make_harness([Behavior.OK], decode, probe_interval=3600.0)
    async with h.session.post(h.url + "/v1/completions", json={**BODY, "stream": stream}) as resp:
        await resp.read()
        assert resp.status == status
    assert await releases_of(h.prefill[0]) == [{"remote_request_id": "req-7",
                                               "remote_lease_secret": f"secret-{h.prefill_ports[0]}"}]


async def test_a_lease_the_decode_node_took_is_left_to_it(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    async with h.session.post(h.url + "/v1/completions", json=BODY) as resp:
        assert resp.status == 200
    await asyncio.sleep(0.1)
    assert h.prefill[0].releases == []
